"""gpt-oss (``GptOssForCausalLM``: gpt-oss-20b, gpt-oss-120b): GQA attention with biases and a
learned sink logit per head, sliding-window and full attention alternating (no tensor of its
own), and in every layer a MoE whose router and experts carry biases and whose experts apply a
clamped SwiGLU.

The HF checkpoint stacks the experts: ``mlp.experts.gate_up_proj`` ``(E, H, 2F)`` with gate
and up **interleaved** along the last dim (``gate = [..., ::2]``, ``up = [..., 1::2]``),
``gate_up_proj_bias`` ``(E, 2F)``, ``down_proj`` ``(E, F, H)`` (``x @ down_proj[e]``) and
``down_proj_bias`` ``(E, H)``. The plan addresses the interleaved pair as its own dim --
``(E, H, F, 2)`` and ``(E, F, 2)``, the same row-major storage (``Row.checkpoint``) -- so both
libraries' layouts are boxes:

- megatron-core's ``SequentialMLP`` expert ``i`` holds ``linear_fc1.weight`` ``[gate_r; up_r]``
  (``[2F/etp, H]``: gate and up de-interleaved and transposed, ``MLP.glu`` chunks them), its
  bias the same way, ``linear_fc2.weight`` ``[H, F/etp]`` (``down_proj[e]`` transposed) and
  ``linear_fc2.bias`` ``[H]`` whole;
- vLLM's ``FusedMoE`` (``GptOssRoutedExperts``, unquantized) holds ``w13_weight[j]`` as
  ``gate_up_proj[e, :, 2F/tp r : 2F/tp (r+1)]`` transposed, gate and up still interleaved
  (``swigluoai`` reads them so), ``w13_bias`` likewise, ``w2_weight[j]`` as ``down_proj[e]``'s
  rows of the rank transposed, and ``w2_bias`` on MoE-TP rank 0 only (the others hold zeros:
  the row-parallel sum adds it once).

The published checkpoints are MXFP4 (``quantization_config``); a refit moves what the policy
trains, the bf16 (or fp32) weights, into an engine loaded unquantized from the same names.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..descriptor import LayoutError
from ..family import Block, Family, Rep, Row, Split, standard_dims
from .common import embedding, final, gqa_attention, post_attention_norm

__all__ = ["GPT_OSS", "TINY_GPT_OSS"]

#: gpt-oss shaped: 4 layers (sliding, full, sliding, full), GQA P = 2 with biases and sinks,
#: 8 experts top-2 with biases. Weights are drawn at N(0, 0.2) by the tests: at 0.02 the tiny
#: model repeats one token under greedy decoding. YaRN factor 1 is plain RoPE (the CPU
#: megatron build runs plain RoPE only); a window of 8 tokens so that short prompts use it.
TINY_GPT_OSS: dict[str, Any] = dict(
    architectures=["GptOssForCausalLM"],
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention"] * 2,
    vocab_size=1000,
    max_position_embeddings=512,
    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=1.0, beta_fast=32.0, beta_slow=1.0,
                         truncate=False, original_max_position_embeddings=512),
    rms_norm_eps=1e-5,
    swiglu_limit=7.0,
    attention_bias=True,
    tie_word_embeddings=False,
)


def _experts() -> Block:
    """The stacked experts (HF dims after the expert dim: gate_up (H, F, 2), its bias (F, 2),
    down (F, H), its bias (H,))."""
    e = "mlp.experts."
    return Block((
        Row(e + "gate_up_proj", ("E", "H", "FE", 2), checkpoint=("E", "H", "FE2"),
            megatron=Split("linear_fc1.weight", rows=(2, 1), cols=(0,), split=1),
            vllm=Split("w13_weight", rows=(1, 2), cols=(0,), split=1)),
        Row(e + "gate_up_proj_bias", ("E", "FE", 2), checkpoint=("E", "FE2"),
            megatron=Split("linear_fc1.bias", rows=(1, 0), split=0),
            vllm=Split("w13_bias", rows=(0, 1), split=0)),
        Row(e + "down_proj", ("E", "FE", "H"),
            megatron=Split("linear_fc2.weight", rows=(1,), cols=(0,), split=0),
            vllm=Split("w2_weight", rows=(1,), cols=(0,), split=0)),
        Row(e + "down_proj_bias", ("E", "H"),
            megatron=Split("linear_fc2.bias", rows=(0,), split=None),
            vllm=Split("w2_bias", rows=(0,), split="rank0")),
    ), experts=True, stacked=True)


def _router() -> tuple[Row, ...]:
    """The norm and a router with a bias (HF ``GptOssTopKRouter``: top-k of the logits, then a
    softmax over them)."""
    return (post_attention_norm(dense=False),
            Row("mlp.router.weight", ("E", "H"), megatron=Rep("mlp.router.weight"), vllm=Rep("mlp.router.weight")),
            Row("mlp.router.bias", ("E",), megatron=Rep("mlp.router.bias"), vllm=Rep("mlp.router.bias")))


def _read(cfg: Mapping[str, Any]) -> dict[str, Any]:
    L = int(cfg["num_hidden_layers"])
    E = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    if E <= 0:
        raise LayoutError("gpt-oss: num_local_experts must be > 0 (every gpt-oss layer is a MoE)")
    bias = bool(cfg.get("attention_bias", True))
    F = int(cfg["intermediate_size"])
    return dict(qkv_bias=bias, o_bias=bias, num_experts=E, moe_intermediate=F, intermediate=F,
                moe_topk=int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 0),
                moe_layers=tuple(range(L)))


def _dims(spec: Any) -> dict[str, int]:
    return {**standard_dims(spec), "FE2": 2 * spec.moe_intermediate}


def _layers(spec: Any, layer: int) -> tuple[str, ...]:
    return ("attention", "moe", "experts")


def megatron_config(spec: Any) -> dict[str, Any]:
    """megatron-core 0.19's gpt-oss: every linear with a bias (``add_bias_linear``: qkv, proj,
    router, experts), learnable softmax offsets (the sinks), sliding windows on every other
    layer (``window_attn_skip_freq=2``: layer 1 windowed, 2 full, as HF's ``layer_types``),
    and the experts' clamped SwiGLU: ``quick_gelu(min(gate, limit)) * (clamp(up, ±limit) + 1)``
    (``activation_func_clamp_value``, ``glu_linear_offset``); routing: softmax over the top-k
    logits (``moe_router_pre_softmax=False``)."""
    hf = spec.hf_config
    types = list(hf.get("layer_types") or [])
    want = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(spec.num_layers)]
    if types and types != want:
        raise LayoutError(f"gpt-oss: layer_types {types[:4]}... is not sliding/full alternating from layer 0, "
                          "the pattern megatron-core's window_attn_skip_freq=2 builds")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if rope.get("rope_type", "yarn") == "yarn" and float(rope.get("factor", 1.0)) != 1.0:
        raise LayoutError(f"gpt-oss: the CPU megatron build runs plain RoPE only; rope factor "
                          f"{rope.get('factor')} (YaRN) is not built here")
    window = int(hf.get("sliding_window") or 0)
    return dict(add_bias_linear=True, add_qkv_bias=True, softmax_type="learnable",
                window_size=(window - 1, 0) if window else None, window_attn_skip_freq=2 if window else None,
                activation_func="quick_gelu", activation_func_clamp_value=float(hf.get("swiglu_limit", 7.0)),
                glu_linear_offset=1.0, moe_router_pre_softmax=False, moe_router_score_function="softmax",
                rotary_base=float(rope.get("rope_theta") or hf.get("rope_theta") or 150000.0))


GPT_OSS = Family(
    name="gpt_oss", title="gpt-oss", architectures=("GptOssForCausalLM",), model_types=("gpt_oss",), read=_read,
    blocks={"attention": Block(gqa_attention("attn.", sinks=True)), "moe": Block(_router()), "experts": _experts()},
    layers=_layers, pre=embedding("model.embedding.weight"), post=final(), dims=_dims,
    megatron_config=megatron_config, tiny=TINY_GPT_OSS, tiny_std=0.2,
    notes=("gpt-oss: the refit carries the policy's weights unquantized (the published checkpoints' experts are "
           "MXFP4); mlp.experts.gate_up_proj(_bias) is addressed as (E, H, F, 2) [gate, up] pairs, the "
           "checkpoint's (E, H, 2F) interleaved",),
)
