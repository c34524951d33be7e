"""A block-FP8 engine as a refit destination: what it holds, and how codes go live.

vLLM's online block FP8 (``quantization="fp8_per_block"``) loads bf16 weights and quantizes
each linear and MoE layer after loading (``Fp8PerBlockOnline*Method``): the layer then holds
``float8_e4m3fn`` codes (VNNI-packed on CPU) and fp32 ``weight_scale_inv`` block scales. A
refit quantized at the senders (``layout.quant``) arrives as exactly those codes and scales, bit
for bit what the online quantization makes of the same shard, so the worker:

* **describes itself in FP8** (``engine_holds``): the pieces it records with vLLM's loaders
  (model format, bf16) quantized as the rules quantize them (``layout.quant.quantize_side``),
  checked against which of its modules really hold FP8;
* **writes the codes into a shadow of the layer** that holds FP8 model-format tensors
  (``open_codes``: fresh codes and scales in place of the bf16 weights vLLM's reload restores);
* **runs the kernel's processing only** (``process_codes``): the linear kernel's VNNI packing
  (``fp8_linear.process_weights_after_loading``), the MoE's ``_setup_kernel`` -- never the
  online quantization, which would quantize codes as if they were bf16.

The MoE's kernel holds its scales (its ``moe_quant_config``), so the shadow is processed by a
copy of the layer's quant method: the live layer keeps computing with its own kernel until the
commit carries the copy over (``layers.commit_shadow``), and a refit that fails leaves it as
it was (no old codes with new scales).
"""

from __future__ import annotations

import copy
from typing import Any, Mapping, Sequence

import torch

from ...layout import SideLayout
from ...layout.descriptor import LayoutError, LocalParam
from ...layout.quant import FP8, SCALE_SUFFIX, BlockFp8, quantize_side, quantized_tensors, scale_name
from ...transport.quantize import per_block_fp8
from ...transport.views import TORCH_DTYPES

__all__ = ["ONLINE_BLOCK_FP8", "FP8_NOTE", "engine_fp8", "engine_quantization", "engine_holds", "holds_codes",
           "open_codes", "process_codes", "quantized_checkpoint"]

#: vLLM's online block-FP8 quant methods, linear and MoE (``fp8_per_block``).
ONLINE_BLOCK_FP8 = ("Fp8PerBlockOnlineLinearMethod", "Fp8PerBlockOnlineMoEMethod")
#: Why an FP8 layer's codes and scales are not written in place (the plan report lists them with it).
FP8_NOTE = ("block FP8 codes + scales: written into a shadow of the layer, then packed by vLLM's FP8 kernel "
            "(never quantized again)")
#: The flag ``open_codes`` leaves on a shadow whose FP8 tensors take codes and scales.
_CODES = "_mr_fp8_codes"


def engine_fp8(vllm_config: Any) -> BlockFp8 | None:
    """What the engine quantizes (its ``quantization_config.ignore`` list), or None when it is
    not a block-FP8 engine."""
    if getattr(getattr(vllm_config, "model_config", None), "quantization", None) != "fp8_per_block":
        return None
    ignore = getattr(getattr(vllm_config, "quant_config", None), "ignored_layers", None) or ()
    return BlockFp8(ignore=tuple(ignore))


def engine_quantization(vllm_config: Any) -> str | None:
    """The engine's ``quantization`` as ``VllmParallel`` names it: ``fp8_per_block`` for a
    block-FP8 engine, else None (its own dtype)."""
    return "fp8_per_block" if engine_fp8(vllm_config) is not None else None


def _method(layer: Any) -> str:
    return type(getattr(layer, "quant_method", None)).__name__


def engine_holds(model: torch.nn.Module, recorded: Sequence[LocalParam],
                 tensors: Mapping[str, tuple[Sequence[int], str]], vllm_config: Any) -> list[LocalParam]:
    """This worker's pieces as the engine holds them: ``recorded`` (model format, learnt from
    vLLM's loaders) quantized as the rules quantize the engine's layout, for a block-FP8
    engine; unchanged for any other. Refused in one line where the rules' choice of FP8
    tensors and the modules holding FP8 disagree (a refit would write bf16 where codes are
    served, or the reverse)."""
    fp8 = engine_fp8(vllm_config)
    if fp8 is None:
        return list(recorded)
    side = quantize_side(SideLayout("vllm", 1, tuple(recorded), {n: (tuple(s), d) for n, (s, d) in tensors.items()}),
                         fp8, "vllm")
    for p in side.params:
        if p.name.endswith(SCALE_SUFFIX):
            continue
        module = model.get_submodule(p.name.rpartition(".")[0])
        if (p.dtype == FP8) != (_method(module) in ONLINE_BLOCK_FP8):
            raise LayoutError(f"{p.name}: the rules describe it {'in FP8' if p.dtype == FP8 else 'unquantized'} but "
                              f"vLLM's {_method(module)} holds it {'unquantized' if p.dtype == FP8 else 'in FP8'} "
                              f"(quantization_config.ignore={list(fp8.ignore)})")
    return list(side.params)


def holds_codes(names: Mapping[str, str], params: Mapping[str, LocalParam]) -> bool:
    """Whether a module's written parameters (attribute -> local name) arrive as FP8 codes."""
    return any(params[local].dtype == FP8 for local in names.values())


def open_codes(shadow: torch.nn.Module, names: Mapping[str, str], params: Mapping[str, LocalParam],
               device: torch.device) -> None:
    """Put fresh FP8 model-format tensors (codes and fp32 scales, of the described shapes) into
    ``shadow`` for every written attribute, in place of the bf16 weights vLLM's reload restored
    (the online method's model format): the refit writes codes and scales there."""
    for attr, local in names.items():
        lp = params[local]
        t = torch.empty(tuple(lp.shape), dtype=TORCH_DTYPES[lp.dtype], device=device)
        shadow._parameters[attr] = torch.nn.Parameter(t, requires_grad=False)
    shadow.__dict__[_CODES] = True


def process_codes(shadow: torch.nn.Module, device: torch.device) -> bool:
    """The kernel's processing of a shadow ``open_codes`` filled (see the module docstring);
    False when ``shadow`` is not such a shadow (vLLM's own processing applies)."""
    if not shadow.__dict__.get(_CODES):
        return False
    qm = copy.copy(shadow.quant_method)  # its kernel state is the shadow's until the commit
    shadow.__dict__["quant_method"] = qm
    name = type(qm).__name__
    with device, torch.no_grad():
        if name == "Fp8PerBlockOnlineLinearMethod":
            shadow.input_scale = None
            qm.fp8_linear = copy.copy(qm.fp8_linear)
            qm.fp8_linear.process_weights_after_loading(shadow)
        elif name == "Fp8PerBlockOnlineMoEMethod":
            shadow.weight_block_size = qm.weight_block_size
            qm._setup_kernel(shadow, shadow.w13_weight, shadow.w2_weight, shadow.w13_weight_scale_inv,
                             shadow.w2_weight_scale_inv, shadow.w13_input_scale, shadow.w2_input_scale)
        else:
            raise LayoutError(f"FP8 codes arrived for a layer of {name}: only {list(ONLINE_BLOCK_FP8)} take them")
    shadow._already_called_process_weights_after_loading = True
    return True


def quantized_checkpoint(canon: Mapping[str, torch.Tensor], fp8: BlockFp8,
                         dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A checkpoint's canonical tensors as an FP8 engine of model dtype ``dtype`` takes them:
    every tensor ``fp8`` quantizes as codes plus its ``_scale_inv`` scales, quantized from
    ``dtype`` as vLLM's online quantization does after loading (and as the senders do,
    ``per_block_fp8``), the rest as they are. Quantizing the whole tensor equals quantizing
    each shard: FP8 layouts hold whole blocks only (``layout.quant``)."""
    out = dict(canon)
    for name in quantized_tensors({n: (tuple(t.shape), str(t.dtype)) for n, t in canon.items()}, fp8):
        out[name], out[scale_name(name)] = per_block_fp8(canon[name].to(dtype))
    return out
