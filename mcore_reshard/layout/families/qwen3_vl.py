"""Qwen3-VL-MoE (``Qwen3VLMoeForConditionalGeneration``): Qwen3-VL's vision tower, its patch
merger and deepstack mergers, and a Qwen3-MoE language model whose HF checkpoint stacks each
layer's experts in two tensors.

Where each library holds them:

- megatron: Megatron-Bridge's Qwen3-VL (``models/qwen_vl/qwen3_vl_bridge.py``; megatron-core
  has no such model, so this side is planned from the Bridge's mappings and not built here):
  ``vision_model.patch_embed.proj`` (Conv3d) and ``pos_embed`` replicated; its blocks are
  ``vision_model.decoder.layers.{i}`` with the ViT layer spec: ``linear_qkv`` per head
  ``[q_h; k_h; v_h]`` (``ConcatenatedQKVMapping`` of HF's contiguous ``[q; k; v]``: the
  per-head reorder), chunked over the language model's TP, LayerNorms fused into the next
  linear (TE; the local form keeps them separate); ``vision_model.merger`` and
  ``vision_model.decoder.deepstack_merger_list.{k}``: ``patch_norm`` replicated, ``linear_fc1``
  column- and ``linear_fc2`` row-parallel. ``language_model.`` is a ``GPTModel`` (Qwen3-MoE).
- vLLM (``qwen3_vl.py``, ``qwen3_vl_moe.py``): ``visual.*`` with ``attn.qkv`` a
  ``QKVParallelLinear`` that slices HF's fused ``[q; k; v]`` (``[q_r; k_r; v_r]`` per rank, no
  reorder), ``attn.proj`` / ``linear_fc2`` row-, ``linear_fc1`` column-parallel, the rest
  replicated; with ``mm_encoder_tp_mode="data"`` the whole tower on every rank.
  ``language_model.model.*`` / ``language_model.lm_head``.
- The experts: HF ``gate_up_proj`` ``(E, H, 2 * FE)`` is ``[gate | up]`` along its last dim,
  addressed as ``(E, H, 2, FE)``; ``down_proj`` ``(E, FE, H)``: both transposed against
  megatron's ``linear_fc1`` ``[gate_r; up_r]`` / ``linear_fc2`` and vLLM's ``w13`` / ``w2``.

Plan-only here: megatron-core builds no Qwen3-VL model (``adapters/megatron/vlm.py`` refuses
it), and the vLLM CPU build was not run on it.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..descriptor import LayoutError
from ..family import QKV, Block, Col, Family, Rep, Row, RowPar, Split, Tower, standard_dims
from ..vision import qwen_tp_sizes, read_qwen_vision
from .common import embedding, final, language_model, moe_router
from .dense import DENSE_BLOCKS
from .qwen3_moe import _read as _qwen3_moe_read

__all__ = ["QWEN3_VL_MOE", "TINY_QWEN3_VL_MOE"]

_V, _MV = "model.visual.", "vision_model."
_QKV = "self_attention.linear_qkv."


def _block() -> tuple[Row, ...]:
    """One vision block (HF ``blocks.{i}.``): the fused qkv's three parts each a row."""
    rows = [Row(f"norm1.{p}", ("H",), vllm=Rep(f"norm1.{p}"),
                megatron=Rep(f"input_layernorm.{p}", te=Rep(f"{_QKV}layer_norm_{p}"))) for p in ("weight", "bias")]
    for p, cols in (("weight", ("H",)), ("bias", ())):
        for i in range(3):  # HF's [q; k; v]: megatron interleaves them per head, vLLM slices each
            rows.append(Row(f"attn.qkv.{p}", ("Q3", *cols), part=(("Q", "2Q")[i - 1] if i else 0, "Q"),
                            megatron=QKV(_QKV + p), vllm=Col(f"attn.qkv.{p}")))
    rows += [Row("attn.proj.weight", ("H", "H"), megatron=RowPar("self_attention.linear_proj.weight"),
                 vllm=RowPar("attn.proj.weight")),
             Row("attn.proj.bias", ("H",), megatron=Rep("self_attention.linear_proj.bias"), vllm=Rep("attn.proj.bias"))]
    rows += [Row(f"norm2.{p}", ("H",), vllm=Rep(f"norm2.{p}"),
                 megatron=Rep(f"pre_mlp_layernorm.{p}", te=Rep(f"mlp.linear_fc1.layer_norm_{p}"))) for p in ("weight", "bias")]
    rows += [Row("mlp.linear_fc1.weight", ("F", "H"), megatron=Col("mlp.linear_fc1.weight"), vllm=Col("mlp.linear_fc1.weight")),
             Row("mlp.linear_fc1.bias", ("F",), megatron=Col("mlp.linear_fc1.bias"), vllm=Col("mlp.linear_fc1.bias")),
             Row("mlp.linear_fc2.weight", ("H", "F"), megatron=RowPar("mlp.linear_fc2.weight"), vllm=RowPar("mlp.linear_fc2.weight")),
             Row("mlp.linear_fc2.bias", ("H",), megatron=Rep("mlp.linear_fc2.bias"), vllm=Rep("mlp.linear_fc2.bias"))]
    return tuple(rows)


def _merger(hf: str, megatron: str, vllm: str, norm: str) -> tuple[Row, ...]:
    """A patch merger: a LayerNorm (over ``norm``: the block width, or the merged width for a
    deepstack merger), then ``linear_fc1`` (column) and ``linear_fc2`` (row) into the LM."""
    return tuple(
        [Row(f"{hf}norm.{p}", (norm,), megatron=Rep(f"{megatron}patch_norm.{p}"), vllm=Rep(f"{vllm}norm.{p}"))
         for p in ("weight", "bias")]
        + [Row(f"{hf}linear_fc1.weight", ("M", "M"), megatron=Col(f"{megatron}linear_fc1.weight"),
               vllm=Col(f"{vllm}linear_fc1.weight")),
           Row(f"{hf}linear_fc1.bias", ("M",), megatron=Col(f"{megatron}linear_fc1.bias"), vllm=Col(f"{vllm}linear_fc1.bias")),
           Row(f"{hf}linear_fc2.weight", ("T", "M"), megatron=RowPar(f"{megatron}linear_fc2.weight"),
               vllm=RowPar(f"{vllm}linear_fc2.weight")),
           Row(f"{hf}linear_fc2.bias", ("T",), megatron=Rep(f"{megatron}linear_fc2.bias"), vllm=Rep(f"{vllm}linear_fc2.bias"))])


def _deepstack(spec: Any) -> tuple[Row, ...]:
    return tuple(r for k in range(len(spec.vision.deepstack))
                 for r in _merger(f"{_V}deepstack_merger_list.{k}.", f"{_MV}decoder.deepstack_merger_list.{k}.",
                                  f"visual.deepstack_merger_list.{k}.", "M"))


_PRE = (
    Row(_V + "patch_embed.proj.weight", ("H", "C", "TP", "P", "P"), megatron=Rep(_MV + "patch_embed.proj.weight"),
        vllm=Rep("visual.patch_embed.proj.weight")),
    Row(_V + "patch_embed.proj.bias", ("H",), megatron=Rep(_MV + "patch_embed.proj.bias"),
        vllm=Rep("visual.patch_embed.proj.bias")),
    Row(_V + "pos_embed.weight", ("N", "H"), megatron=Rep(_MV + "pos_embed.weight"), vllm=Rep("visual.pos_embed.weight")),
)


def _tower_dims(spec: Any) -> dict[str, int]:
    v = spec.vision
    return dict(H=v.hidden, heads=v.heads, kv_heads=v.heads, D=v.head_dim, Q=v.hidden, KV=v.hidden, Q3=3 * v.hidden,
                **{"2Q": 2 * v.hidden}, F=v.intermediate, M=v.merged, T=spec.hidden, C=v.channels, TP=v.temporal_patch,
                P=v.patch, N=v.positions)


TOWER = Tower(pre=_PRE, layer=_block(), post=_merger(_V + "merger.", _MV + "merger.", "visual.merger.", "H"),
              layers=lambda spec: spec.vision.layers, dims=_tower_dims, flags=lambda spec: frozenset(),
              hf_layer=_V + "blocks.{layer}.", megatron_layer=_MV + "decoder.layers.{layer}.",
              vllm_layer="visual.blocks.{layer}.", extra=_deepstack, vllm_data_parallel=True,
              tp_sizes=lambda spec: qwen_tp_sizes(spec, "mlp.linear_fc1", "merger.linear_fc1"),
              projector=(_V + "merger.", _V + "deepstack_merger_list."))


def _stacked_experts() -> Block:
    """HF's stacked experts (dims after the expert dim): gate_up ``(H, 2, FE)`` as ``[gate |
    up]`` halves, down ``(FE, H)``; megatron's local expert and vLLM's slot hold each
    transposed, ``[gate_r; up_r]``."""
    e = "mlp.experts."
    return Block((
        Row(e + "gate_up_proj", ("E", "H", 2, "FE"), checkpoint=("E", "H", "FE2"),
            megatron=Split("linear_fc1.weight", rows=(1, 2), cols=(0,), split=2),
            vllm=Split("w13_weight", rows=(1, 2), cols=(0,), split=2)),
        Row(e + "down_proj", ("E", "FE", "H"),
            megatron=Split("linear_fc2.weight", rows=(1,), cols=(0,), split=0),
            vllm=Split("w2_weight", rows=(1,), cols=(0,), split=0)),
    ), experts=True, stacked=True)


def _hf_lm(name: str) -> str:
    """The checkpoint's language model: HF's ``model.`` becomes ``model.language_model.``."""
    return "model.language_model." + name[len("model."):] if name.startswith("model.") else name


def _read(cfg: Mapping[str, Any]) -> dict[str, Any]:
    text = dict(cfg.get("text_config") or {})
    if cfg.get("tie_word_embeddings") or text.get("tie_word_embeddings"):
        raise LayoutError("Qwen3-VL-MoE with tie_word_embeddings: not described")
    out = _qwen3_moe_read(text)
    out.update(vision=read_qwen_vision(cfg, int(text["hidden_size"])), tied=False)
    return out


def _dims(spec: Any) -> dict[str, int]:
    return dict(standard_dims(spec), FE2=2 * spec.moe_intermediate)


def _layers(spec: Any, layer: int) -> tuple[str, ...]:
    return ("attention", "moe", "experts") if spec.is_moe(layer) else ("attention", "mlp")


def _megatron_config(spec: Any) -> dict[str, Any]:
    """megatron-core 0.19.2 builds no Qwen3-VL model (Megatron-Bridge's own modules do)."""
    raise LayoutError("Qwen3-VL-MoE: megatron-core 0.19.2 has no Qwen3-VL model (Megatron-Bridge builds its own "
                      "modules): its layouts are planned from the Bridge's mappings, not built on this machine")


#: The tests' tiny Qwen3-VL-MoE: 3 vision blocks (deepstack after blocks 0 and 1), a 2-layer
#: Qwen3-MoE of 4 experts; shapes only (plans on metadata).
TINY_QWEN3_VL_MOE: dict[str, Any] = dict(
    architectures=["Qwen3VLMoeForConditionalGeneration"],
    model_type="qwen3_vl_moe",
    tie_word_embeddings=False,
    image_token_id=151655,
    vision_config=dict(depth=3, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=64,
                       deepstack_visual_indexes=[0, 1], patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                       num_position_embeddings=16, in_channels=3),
    text_config=dict(hidden_size=64, num_hidden_layers=2, num_experts=4, moe_intermediate_size=32,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1000,
                     intermediate_size=128, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                     rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=False,
                     norm_topk_prob=True,  # vLLM reads it (transformers 5 no longer declares it)
                     rope_theta=500000.0),
)

QWEN3_VL_MOE = Family(
    name="qwen3_vl_moe", title="Qwen3-VL-MoE", architectures=("Qwen3VLMoeForConditionalGeneration",),
    model_types=("qwen3_vl_moe",), read=_read,
    blocks={**DENSE_BLOCKS, "moe": Block(moe_router()), "experts": _stacked_experts()}, layers=_layers,
    pre=language_model(embedding(), _hf_lm), post=language_model(final(), _hf_lm),
    dims=_dims, hf_layer="model.language_model.layers.{layer}.", vllm_layer="language_model.model.layers.{layer}.",
    tower=TOWER, text_config="text_config", megatron_prefix="language_model.", tiny=TINY_QWEN3_VL_MOE,
    megatron_config=_megatron_config,
    notes=("Qwen3-VL-MoE: the megatron side is Megatron-Bridge's layout (megatron-core has no Qwen3-VL model): "
           "planned from its mappings, not built here",),
)
