"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): Qwen2.5-VL's vision tower (RMSNorm, a
SwiGLU MLP, window attention -- no extra weights), its patch merger, and a Qwen2 language model.

Canonical names are the hub checkpoints' (``visual.*``, ``model.layers.*``, ``lm_head``), which
transformers 5 also writes. Where each library holds them:

- megatron: Megatron-Bridge's Qwen2.5-VL (``models/qwen_vl/qwen25_vl_bridge.py``) embeds HF's own
  tower module and maps it whole (``ReplicatedMapping("visual.**")``): every training rank
  holds the whole tower under HF's names; ``language_model.`` is a ``GPTModel`` (Qwen2: q/k/v
  biases). megatron-core has no such model, so this side is planned from the Bridge's mappings
  and not built here.
- vLLM (``qwen2_5_vl.py``): ``visual.*`` sharded over TP (``attn.qkv`` slices HF's fused
  ``[q; k; v]`` per rank; ``mlp.gate_up_proj`` ``[gate_r; up_r]``; ``attn.proj``, ``down_proj``
  and ``merger.mlp.2`` row-parallel, ``merger.mlp.0`` column-parallel), or whole on every rank
  with ``mm_encoder_tp_mode="data"``; ``language_model.model.*`` / ``language_model.lm_head``.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..descriptor import LayoutError
from ..family import Block, Col, Family, Rep, Row, RowPar, Tower
from ..vision import qwen_tp_sizes, read_qwen_vision
from .common import dense_mlp, embedding, final, gqa_attention, language_model

__all__ = ["QWEN2_5_VL", "TINY_QWEN2_5_VL"]


def _block() -> tuple[Row, ...]:
    """One vision block (HF ``visual.blocks.{i}.``); megatron holds every tensor whole (HF's module)."""
    rows = [Row("norm1.weight", ("H",), megatron=Rep("norm1.weight"), vllm=Rep("norm1.weight"))]
    for p, cols in (("weight", ("H",)), ("bias", ())):
        for i in range(3):  # HF's fused [q; k; v]: vLLM's QKVParallelLinear slices each part
            rows.append(Row(f"attn.qkv.{p}", ("Q3", *cols), part=(("Q", "2Q")[i - 1] if i else 0, "Q"),
                            megatron=Rep(f"attn.qkv.{p}"), vllm=Col(f"attn.qkv.{p}")))
    rows += [Row("attn.proj.weight", ("H", "H"), megatron=Rep("attn.proj.weight"), vllm=RowPar("attn.proj.weight")),
             Row("attn.proj.bias", ("H",), megatron=Rep("attn.proj.bias"), vllm=Rep("attn.proj.bias")),
             Row("norm2.weight", ("H",), megatron=Rep("norm2.weight"), vllm=Rep("norm2.weight"))]
    for p, cols in (("weight", ("H",)), ("bias", ())):
        for proj in ("gate", "up"):
            rows.append(Row(f"mlp.{proj}_proj.{p}", ("F", *cols), megatron=Rep(f"mlp.{proj}_proj.{p}"),
                            vllm=Col(f"mlp.gate_up_proj.{p}")))
    rows += [Row("mlp.down_proj.weight", ("H", "F"), megatron=Rep("mlp.down_proj.weight"), vllm=RowPar("mlp.down_proj.weight")),
             Row("mlp.down_proj.bias", ("H",), megatron=Rep("mlp.down_proj.bias"), vllm=Rep("mlp.down_proj.bias"))]
    return tuple(rows)


_M = "visual.merger."
_PRE = (Row("visual.patch_embed.proj.weight", ("H", "C", "TP", "P", "P"), megatron=Rep("visual.patch_embed.proj.weight"),
            vllm=Rep("visual.patch_embed.proj.weight")),)
_MERGER = (
    Row(_M + "ln_q.weight", ("H",), megatron=Rep(_M + "ln_q.weight"), vllm=Rep(_M + "ln_q.weight")),
    Row(_M + "mlp.0.weight", ("M", "M"), megatron=Rep(_M + "mlp.0.weight"), vllm=Col(_M + "mlp.0.weight")),
    Row(_M + "mlp.0.bias", ("M",), megatron=Rep(_M + "mlp.0.bias"), vllm=Col(_M + "mlp.0.bias")),
    Row(_M + "mlp.2.weight", ("T", "M"), megatron=Rep(_M + "mlp.2.weight"), vllm=RowPar(_M + "mlp.2.weight")),
    Row(_M + "mlp.2.bias", ("T",), megatron=Rep(_M + "mlp.2.bias"), vllm=Rep(_M + "mlp.2.bias")),
)


def _tower_dims(spec: Any) -> dict[str, int]:
    v = spec.vision
    return dict(H=v.hidden, heads=v.heads, kv_heads=v.heads, D=v.head_dim, Q=v.hidden, KV=v.hidden, Q3=3 * v.hidden,
                **{"2Q": 2 * v.hidden}, F=v.intermediate, M=v.merged, T=spec.hidden, C=v.channels,
                TP=v.temporal_patch, P=v.patch)


TOWER = Tower(pre=_PRE, layer=_block(), post=_MERGER, layers=lambda spec: spec.vision.layers, dims=_tower_dims,
              flags=lambda spec: frozenset(), hf_layer="visual.blocks.{layer}.", megatron_layer="visual.blocks.{layer}.",
              vllm_layer="visual.blocks.{layer}.", vllm_data_parallel=True, projector=(_M,),
              tp_sizes=lambda spec: qwen_tp_sizes(spec, "mlp.gate_up_proj", "merger.mlp.0"), megatron_whole=True)


def _read(cfg: Mapping[str, Any]) -> dict[str, Any]:
    text = dict(cfg.get("text_config") or {})
    if cfg.get("tie_word_embeddings") or text.get("tie_word_embeddings"):
        raise LayoutError("Qwen2.5-VL with tie_word_embeddings (the 3B): not described")
    return dict(vision=read_qwen_vision(cfg, int(text["hidden_size"])), qkv_bias=True, tied=False)


def _megatron_config(spec: Any) -> dict[str, Any]:
    raise LayoutError("Qwen2.5-VL: megatron-core 0.19.2 has no Qwen2.5-VL model (Megatron-Bridge embeds HF's tower): "
                      "its layouts are planned from the Bridge's mappings, not built on this machine")


#: The tests' tiny Qwen2.5-VL: 2 vision blocks, a 2-layer Qwen2 (q/k/v biases); shapes only.
TINY_QWEN2_5_VL: dict[str, Any] = dict(
    architectures=["Qwen2_5_VLForConditionalGeneration"],
    model_type="qwen2_5_vl",
    tie_word_embeddings=False,
    image_token_id=151655,
    vision_config=dict(depth=2, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=128, patch_size=14,
                       spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1],
                       in_channels=3, hidden_act="silu"),
    text_config=dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=256, vocab_size=1000, rms_norm_eps=1e-6, max_position_embeddings=512,
                     tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, rope_theta=1000000.0,
                     rope_scaling=dict(type="mrope", mrope_section=[8, 4, 4])),
)

QWEN2_5_VL = Family(
    name="qwen2_5_vl", title="Qwen2.5-VL", architectures=("Qwen2_5_VLForConditionalGeneration",),
    model_types=("qwen2_5_vl",), read=_read, blocks={"attention": Block(gqa_attention()), "mlp": Block(dense_mlp())},
    layers=lambda spec, layer: ("attention", "mlp"), pre=language_model(embedding()), post=language_model(final()),
    vllm_layer="language_model.model.layers.{layer}.", tower=TOWER, text_config="text_config",
    megatron_prefix="language_model.", tiny=TINY_QWEN2_5_VL, megatron_config=_megatron_config,
    notes=("Qwen2.5-VL: the megatron side is Megatron-Bridge's layout (its tower is HF's module, whole on every "
           "rank; megatron-core has no Qwen2.5-VL model): planned from its mappings, not built here",),
)
