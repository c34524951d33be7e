"""Block-FP8 quantization at the sender (``RankPlan.quantize``).

A training rank quantizes the bf16 shards it sends, block by block, and puts codes and scales
on the wire: half the bytes of bf16, and no bf16 copy ever reaches the engine. The formula is
vLLM's own (``vllm.utils.deep_gemm.per_block_cast_to_fp8``, what an online ``fp8_per_block``
engine runs on every weight it loads), restated here so a trainer does not import vLLM:
``scale = max(amax, 1e-4) / 448`` per 128x128 block, codes = ``(w * (1 / scale))`` cast to
``float8_e4m3fn`` -- a multiply by the reciprocal, not a divide (the two differ in about one
code in 3,000), in fp32. The plan guarantees every block a rank holds lies in one of its
pieces at aligned local coordinates (``layout.quant``), so quantizing the whole local tensor
over its last two dims equals quantizing each canonical tensor.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator, Mapping, Sequence

import torch

from ..layout.quant import BLOCK, SCALE_SUFFIX

__all__ = ["per_block_fp8", "dequantize", "as_sent", "QuantizedSources", "FP8_MAX"]

#: ``torch.finfo(torch.float8_e4m3fn).max``: vLLM's ``get_fp8_min_max()`` on every platform
#: but ROCm's fnuz.
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


def per_block_fp8(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., R, C] -> (codes [..., R, C] in ``float8_e4m3fn``, fp32 scales
    [..., ceil(R/block), ceil(C/block)]): vLLM's ``per_block_cast_to_fp8`` (``use_ue8m0=False``)
    on every leading index, bit for bit."""
    if x.dim() < 2:
        raise ValueError(f"block FP8 needs a tensor of at least 2 dims, got shape {tuple(x.shape)}")
    *lead, r, c = x.shape
    rb, cb = -(-r // block), -(-c // block)
    ragged = bool(r % block or c % block)
    if ragged:  # zero padding: never raises a block's amax
        padded = torch.zeros((*lead, rb * block, cb * block), dtype=x.dtype, device=x.device)
        padded[..., :r, :c] = x
    else:
        padded = x.contiguous()
    blocks = padded.view(-1, rb, block, cb, block)
    # amax in the input dtype, then fp32: a max is exact in either (vLLM converts first)
    amax = blocks.abs().amax(dim=(2, 4), keepdim=True).float().clamp(1e-4)
    scale = amax / FP8_MAX
    codes = (blocks * (1.0 / scale)).to(torch.float8_e4m3fn)  # bf16 x fp32 -> fp32, as vLLM's
    codes = codes.view(*lead, rb * block, cb * block)
    if ragged:
        codes = codes[..., :r, :c].contiguous()
    return codes, scale.view(*lead, rb, cb)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, block: int = BLOCK) -> torch.Tensor:
    """What block-FP8 ``codes`` with their ``scales`` stand for, in ``dtype``: each code times
    its block's scale (the weight an FP8 engine's W8A16 kernel computes with)."""
    r, c = codes.shape[-2:]
    full = scales.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)[..., :r, :c]
    return (codes.float() * full).to(dtype)


@contextlib.contextmanager
def as_sent(tensors: Mapping[str, torch.Tensor], names: Sequence[str]) -> Iterator[None]:
    """While inside, each local tensor of ``names`` holds what an FP8 engine computes with once
    this rank's codes land: its block-FP8 round trip (``per_block_fp8``, then ``dequantize``)
    in its own dtype; put back bit for bit on the way out. A canary reference of a quantized
    refit is the policy that was sent, not the bf16 one (costs a copy of those tensors while
    inside)."""
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for name in names:
                t = tensors[name]
                codes, scales = per_block_fp8(t.detach())
                kept.append((t, t.detach().clone()))
                t.detach().copy_(dequantize(codes, scales, t.dtype))
        yield
    finally:
        with torch.no_grad():
            for t, old in kept:
                t.detach().copy_(old)


class QuantizedSources(Mapping):
    """``tensors`` with the local tensors in ``names`` read as block-FP8 codes (same name) and
    their scales (``<name>_scale_inv``), quantized once, on first use (the refit that reads
    them owns this object). ``seconds``: time spent quantizing; ``nbytes``: what the codes and
    scales hold (the sender's extra memory for them)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], names: Sequence[str]) -> None:
        self.tensors, self.names = tensors, frozenset(names)
        self._done: dict[str, torch.Tensor] = {}
        self.seconds = 0.0
        self.nbytes = 0

    def _quantize(self, name: str) -> None:
        t0 = time.perf_counter()
        codes, scales = per_block_fp8(self.tensors[name].detach())
        self._done[name], self._done[name + SCALE_SUFFIX] = codes, scales
        self.nbytes += codes.numel() + scales.numel() * scales.element_size()
        self.seconds += time.perf_counter() - t0

    def __getitem__(self, name: str) -> torch.Tensor:
        hit = self._done.get(name)
        if hit is not None:
            return hit
        base = name[: -len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else name
        if base in self.names:
            self._quantize(base)
            return self._done[name]
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        yield from self.tensors
        yield from (n + SCALE_SUFFIX for n in sorted(self.names))

    def __len__(self) -> int:
        return len(self.tensors) + len(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors or (isinstance(name, str) and name.endswith(SCALE_SUFFIX)
                                        and name[: -len(SCALE_SUFFIX)] in self.names)
