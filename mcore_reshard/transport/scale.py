"""Tensors the destination holds scaled (``RankPlan.scale``: a LoRA adapter's B, into which
vLLM folds ``alpha / r``), multiplied at the sender while packing.

vLLM's loader casts a PEFT B to the LoRA dtype and multiplies it in place (``lora_b *=
scaling``, ``vllm/lora/lora_weights.py:optimize``); the sender does the same op on its local B
in the wire dtype, so the engine holds bit for bit what loading the same adapter gives.
"""

from __future__ import annotations

from typing import Iterator, Mapping

import torch

__all__ = ["ScaledSources"]


class ScaledSources(Mapping):
    """``tensors`` with the local tensors of ``factors`` (name -> factor) read as
    ``tensor.to(wire) * factor``, computed once, on first use (the refit that reads them owns
    this object: adapters are small). ``nbytes``: the scaled copies' memory."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], factors: Mapping[str, float], wire: torch.dtype) -> None:
        self.tensors, self.factors, self.wire = tensors, dict(factors), wire
        self._done: dict[str, torch.Tensor] = {}
        self.nbytes = 0

    def __getitem__(self, name: str) -> torch.Tensor:
        factor = self.factors.get(name)
        if factor is None:
            return self.tensors[name]
        x = self._done.get(name)
        if x is None:
            x = self.tensors[name].detach().to(self.wire, copy=True).contiguous()
            x *= factor  # vLLM's ``lora_b *= scaling``: the same op, the same bits
            self._done[name] = x
            self.nbytes += x.numel() * x.element_size()
        return x

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)
