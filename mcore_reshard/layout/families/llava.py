"""LLaVA (``LlavaForConditionalGeneration``): a CLIP vision tower, an MLP projector and a
Llama (or Qwen2) language model.

Canonical names are the llava-hf checkpoints' (what vLLM's ``llava.py`` loads as they are):
``vision_tower.vision_model.*``, ``multi_modal_projector.linear_{1,2}.*`` and
``language_model.{model.*, lm_head.weight}``. (transformers 5 saves the tower without its
``vision_model.`` level; ``infra.checkpoint`` writes the hub form.)

Where each library holds them:

- megatron-core's ``LLaVAModel``: ``vision_model.`` a ``CLIPViTModel`` (``conv1`` without bias,
  ``class_token`` ``(1, 1, H)``, ``position_embeddings``, ``ln_pre``, then a transformer block
  whose layers are GPT's: fused per-head ``linear_qkv``, ``linear_proj``, ``linear_fc1/fc2`` with
  biases, LayerNorm); ``vision_projection.encoder.linear_fc{1,2}`` (column- then row-parallel);
  ``language_model.`` a ``GPTModel``. The tower is TP-sharded like the language model.
- vLLM: ``vision_tower.vision_model.`` (``clip.py``: ``qkv_proj`` a ``QKVParallelLinear``,
  ``out_proj`` / ``fc2`` row-parallel, ``fc1`` column-parallel; embeddings and norms
  replicated), ``multi_modal_projector.linear_1`` column- and ``linear_2`` row-parallel, and
  ``language_model.`` the text model. vLLM shards LLaVA's tower by weights whatever
  ``mm_encoder_tp_mode`` says (``supports_encoder_tp_data`` is False for LLaVA).
- LLaVA reads the tower's ``vision_feature_layer``: the layers after it and ``post_layernorm``
  are built by neither library, so they are not described (a plan note says so).
"""

from __future__ import annotations

from typing import Any, Mapping

from ..descriptor import LayoutError
from ..family import QKV, Block, Col, Family, Rep, Row, RowPar, Tower
from ..vision import read_vision
from .common import dense_mlp, embedding, final, gqa_attention, language_model

__all__ = ["LLAVA", "TINY_LLAVA"]

_V = "vision_tower.vision_model."
_QKV = "self_attention.linear_qkv."


def _tower_layer() -> tuple[Row, ...]:
    """One CLIP encoder layer (HF names under ``encoder.layers.{layer}.``)."""
    rows = [Row(f"layer_norm1.{p}", ("H",), vllm=Rep(f"layer_norm1.{p}"),
                megatron=Rep(f"input_layernorm.{p}", te=Rep(f"{_QKV}layer_norm_{p}")))
            for p in ("weight", "bias")]
    for p, shape in (("weight", ("H",) * 2), ("bias", ("H",))):
        for proj in ("q", "k", "v"):
            rows.append(Row(f"self_attn.{proj}_proj.{p}", shape, megatron=QKV(_QKV + p),
                            vllm=Col(f"self_attn.qkv_proj.{p}", units=None if proj == "q" else "kv_heads")))
    rows += [Row("self_attn.out_proj.weight", ("H", "H"), megatron=RowPar("self_attention.linear_proj.weight"),
                 vllm=RowPar("self_attn.out_proj.weight")),
             Row("self_attn.out_proj.bias", ("H",), megatron=Rep("self_attention.linear_proj.bias"),
                 vllm=Rep("self_attn.out_proj.bias"))]
    rows += [Row(f"layer_norm2.{p}", ("H",), vllm=Rep(f"layer_norm2.{p}"),
                 megatron=Rep(f"pre_mlp_layernorm.{p}", te=Rep(f"mlp.linear_fc1.layer_norm_{p}")))
             for p in ("weight", "bias")]
    rows += [Row("mlp.fc1.weight", ("F", "H"), megatron=Col("mlp.linear_fc1.weight"), vllm=Col("mlp.fc1.weight")),
             Row("mlp.fc1.bias", ("F",), megatron=Col("mlp.linear_fc1.bias"), vllm=Col("mlp.fc1.bias")),
             Row("mlp.fc2.weight", ("H", "F"), megatron=RowPar("mlp.linear_fc2.weight"), vllm=RowPar("mlp.fc2.weight")),
             Row("mlp.fc2.bias", ("H",), megatron=Rep("mlp.linear_fc2.bias"), vllm=Rep("mlp.fc2.bias"))]
    return tuple(rows)


_TOWER_PRE = (
    Row(_V + "embeddings.class_embedding", ("H",), megatron=Rep("vision_model.class_token", shape=(1, 1, "H")),
        vllm=Rep(_V + "embeddings.class_embedding")),
    Row(_V + "embeddings.patch_embedding.weight", ("H", "C", "K", "K"), megatron=Rep("vision_model.conv1.weight"),
        vllm=Rep(_V + "embeddings.patch_embedding.weight")),
    Row(_V + "embeddings.position_embedding.weight", ("P", "H"),
        megatron=Rep("vision_model.position_embeddings.weight"), vllm=Rep(_V + "embeddings.position_embedding.weight")),
    Row(_V + "pre_layrnorm.weight", ("H",), megatron=Rep("vision_model.ln_pre.weight"), vllm=Rep(_V + "pre_layrnorm.weight")),
    Row(_V + "pre_layrnorm.bias", ("H",), megatron=Rep("vision_model.ln_pre.bias"), vllm=Rep(_V + "pre_layrnorm.bias")),
)

_M = "multi_modal_projector."
_P = "vision_projection.encoder."
_PROJECTOR = (
    Row(_M + "linear_1.weight", ("T", "H"), megatron=Col(_P + "linear_fc1.weight"), vllm=Col(_M + "linear_1.weight")),
    Row(_M + "linear_1.bias", ("T",), megatron=Col(_P + "linear_fc1.bias"), vllm=Col(_M + "linear_1.bias"),
        when="projector_bias"),
    Row(_M + "linear_2.weight", ("T", "T"), megatron=RowPar(_P + "linear_fc2.weight"), vllm=RowPar(_M + "linear_2.weight")),
    Row(_M + "linear_2.bias", ("T",), megatron=Rep(_P + "linear_fc2.bias"), vllm=Rep(_M + "linear_2.bias"),
        when="projector_bias"),
)


def _tower_dims(spec: Any) -> dict[str, int]:
    v = spec.vision
    return dict(H=v.hidden, heads=v.heads, kv_heads=v.heads, D=v.head_dim, Q=v.hidden, KV=v.hidden,
                F=v.intermediate, P=v.positions, C=v.channels, K=v.patch, T=spec.hidden)


def _tower_flags(spec: Any) -> frozenset[str]:
    return frozenset({"projector_bias"} if spec.vision.projector_bias else ())


TOWER = Tower(pre=_TOWER_PRE, layer=_tower_layer(), post=_PROJECTOR, layers=lambda spec: spec.vision.layers,
              dims=_tower_dims, flags=_tower_flags, hf_layer=_V + "encoder.layers.{layer}.",
              megatron_layer="vision_model.decoder.layers.{layer}.", vllm_layer=_V + "encoder.layers.{layer}.",
              projector=(_M,), tp_sizes=lambda spec: (
                  ("vision_config.num_attention_heads", spec.vision.heads, "self_attn.qkv_proj"),
                  ("vision_config.intermediate_size", spec.vision.intermediate, "mlp.fc1"),
                  ("text_config.hidden_size", spec.hidden, "multi_modal_projector.linear_1")))


_TEXT_MODELS = ("llama", "qwen2")


def _llava_hf(name: str) -> str:
    """llava-hf's checkpoints hold the language model under ``language_model.``."""
    return "language_model." + name


def _read(cfg: Mapping[str, Any]) -> dict[str, Any]:
    text = cfg.get("text_config") or {}
    mtype = text.get("model_type", "llama")
    if mtype not in _TEXT_MODELS:
        raise LayoutError(f"LLaVA text_config.model_type={mtype!r}: the table describes a {' or '.join(_TEXT_MODELS)} "
                          f"language model")
    if text.get("tie_word_embeddings") or cfg.get("tie_word_embeddings"):
        raise LayoutError("LLaVA with tie_word_embeddings: megatron-core's LLaVAModel unties them; not described")
    return dict(vision=read_vision(cfg), qkv_bias=mtype == "qwen2" or bool(text.get("attention_bias", False)),
                tied=False)


#: The tests' tiny LLaVA: a 3-layer CLIP tower of which LLaVA uses 2 (``vision_feature_layer``
#: -2, as llava-1.5), 28x28 images of 14x14 patches (4 image tokens), a Llama language model
#: with GQA and head_dim 32 (the CPU attention's minimum).
TINY_LLAVA: dict[str, Any] = dict(
    architectures=["LlavaForConditionalGeneration"],
    model_type="llava",
    image_token_index=999,
    image_seq_length=4,
    projector_hidden_act="gelu",
    vision_feature_layer=-2,
    vision_feature_select_strategy="default",
    multimodal_projector_bias=True,
    tie_word_embeddings=False,
    vision_config=dict(model_type="clip_vision_model", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                       num_attention_heads=4, image_size=28, patch_size=14, num_channels=3, hidden_act="quick_gelu",
                       layer_norm_eps=1e-5, projection_dim=64),
    text_config=dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1000,
                     max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6, attention_bias=False,
                     mlp_bias=False, tie_word_embeddings=False),
)

LLAVA = Family(
    name="llava", title="LLaVA", architectures=("LlavaForConditionalGeneration",), model_types=("llava",),
    read=_read, blocks={"attention": Block(gqa_attention()), "mlp": Block(dense_mlp())},
    layers=lambda spec, layer: ("attention", "mlp"), pre=language_model(embedding(), _llava_hf),
    post=language_model(final(), _llava_hf),
    hf_layer="language_model.model.layers.{layer}.", vllm_layer="language_model.model.layers.{layer}.",
    tower=TOWER, text_config="text_config", megatron_prefix="language_model.", tiny=TINY_LLAVA,
    tiny_biases="zero",
    notes=("LLaVA: the CLIP tower's layers after vision_feature_layer and its post_layernorm are in the checkpoint "
           "but built by neither library: not described, not refit",),
)
