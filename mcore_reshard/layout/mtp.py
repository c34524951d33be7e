"""A model's multi-token-prediction (MTP) layers as canonical tensors: the speculative-decoding
draft both libraries hold beside the target (DeepSeek-V3's ``num_nextn_predict_layers``).

MTP layer ``i`` is HF layer ``L + i`` (``L = num_hidden_layers``): its own ``enorm``, ``hnorm``,
``eh_proj`` ``[H, 2H]`` (input ``[enorm(embedding); hnorm(hidden)]``), ``shared_head.norm``, and
a decoder layer built like the model's last one (megatron-core: ``layer_specs[-1]``; vLLM:
``layer_idx >= first_k_dense_replace``). The checkpoint's ``model.layers.{L+i}.embed_tokens`` and
``shared_head.head`` are not described: both libraries run the draft on the target's embedding
and output head (megatron's MTP block takes ``GPTModel.embedding`` / ``output_layer``; vLLM's
proposer replaces the draft's with the target's), so they move once, as the target's.
Pure metadata: no torch.
"""

from __future__ import annotations

from dataclasses import replace

from typing import Iterable

from .descriptor import LayoutError, LocalParam, SideLayout
from .spec import ModelSpec

__all__ = ["mtp_spec", "draft_tensors", "draft_layers", "with_draft", "skipped_note"]


def draft_layers(spec: ModelSpec) -> range:
    """HF layer indices of the MTP layers."""
    return range(spec.num_layers, spec.num_layers + spec.mtp_layers)


def mtp_spec(spec: ModelSpec) -> ModelSpec:
    """``spec`` with the MTP layers routed (MoE) where its last decoder layer is."""
    if not spec.mtp_layers:
        raise LayoutError(f"{spec.name or spec.arch}: the model has no MTP layers (num_nextn_predict_layers=0)")
    if spec.mla is None:
        raise LayoutError(f"{spec.name or spec.arch}: MTP layers are described for the DeepSeek-V3 family only")
    if spec.is_moe(spec.num_layers - 1):
        return replace(spec, moe_layers=tuple(spec.moe_layers) + tuple(draft_layers(spec)))
    return spec


def draft_tensors(spec: ModelSpec) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every canonical tensor of the MTP layers: name -> (shape, dtype), HF order."""
    s = mtp_spec(spec)
    H, dt = s.hidden, s.dtype
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for layer in draft_layers(s):
        p = f"model.layers.{layer}."
        out[p + "enorm.weight"] = ((H,), dt)
        out[p + "hnorm.weight"] = ((H,), dt)
        out[p + "eh_proj.weight"] = ((H, 2 * H), dt)
        out.update({t.name: (t.shape, t.dtype) for t in s.layer_tensors(layer)})
        out[p + "shared_head.norm.weight"] = ((H,), dt)
    return out


def skipped_note(spec: ModelSpec) -> str:
    """The note of a destination that runs no draft: its model skips the MTP layers."""
    return (f"MTP layers {spec.num_layers}..{spec.num_layers + spec.mtp_layers - 1} "
            f"(num_nextn_predict_layers={spec.mtp_layers}) are not held by the destination: vLLM's "
            "main model skips them (only an MTP speculative-decoding draft loads them); not refit")


def with_draft(side: SideLayout, draft: Iterable[LocalParam], spec: ModelSpec) -> SideLayout:
    """``side`` plus the draft's parameters and tensors: one layout, so the target and its
    draft are planned, moved and voted on as one refit. A destination's note that it skips
    the MTP layers (``skipped_note``) no longer holds: it goes."""
    params = tuple(side.params) + tuple(draft)
    note = f"mtp draft: {spec.mtp_layers} layer(s) after layer {spec.num_layers - 1}"
    return replace(side, params=params, tensors={**side.tensors, **draft_tensors(spec)},
                   notes=tuple(n for n in side.notes if n != skipped_note(spec)) + (note,))
