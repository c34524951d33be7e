"""Rows several families share: GQA attention, the dense SwiGLU MLP, a MoE block's router and
its routed and shared experts, the embedding and the output head (``layout.family``'s form).

Each function returns rows; a family module puts them into its blocks. The megatron names are
``GPTModel.named_parameters()``'s under a decoder layer (local layer spec; ``te=``: the
Transformer-Engine spec's where it differs), the vLLM names ``named_parameters()``'s of its
model class in model format (before ``process_weights_after_loading``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from ..family import QKV, Col, Rep, Row, RowPar, Vocab

__all__ = ["language_model", "gqa_attention", "dense_mlp", "moe_router", "routed_experts", "shared_experts",
           "embedding", "final"]

_QKV_W, _QKV_B = "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"


def gqa_attention(vllm: str = "self_attn.", *, sinks: bool = False) -> tuple[Row, ...]:
    """Input norm, q/k/v (+ biases, ``qkv_bias``), o_proj (+ bias, ``o_bias``), q/k norms
    (``qk_norm``) and attention sinks, in HF order. megatron: one interleaved ``linear_qkv``
    (``QKV``); vLLM: ``qkv_proj`` = ``[q_r; k_s; v_s]`` with KV heads replicated when there are
    fewer than TP ranks. ``vllm``: the attention module's prefix there (gpt-oss: ``attn.``)."""
    qkv_w, qkv_b = vllm + "qkv_proj.weight", vllm + "qkv_proj.bias"
    rows = [Row("input_layernorm.weight", ("H",),
                megatron=Rep("input_layernorm.weight", te=Rep("self_attention.linear_qkv.layer_norm_weight")),
                vllm=Rep("input_layernorm.weight"))]
    for proj, size, units in (("q", "Q", None), ("k", "KV", "kv_heads"), ("v", "KV", "kv_heads")):
        rows.append(Row(f"self_attn.{proj}_proj.weight", (size, "H"), megatron=QKV(_QKV_W),
                        vllm=Col(qkv_w, units=units)))
        rows.append(Row(f"self_attn.{proj}_proj.bias", (size,), megatron=QKV(_QKV_B),
                        vllm=Col(qkv_b, units=units), when="qkv_bias"))
    rows.append(Row("self_attn.o_proj.weight", ("H", "Q"), megatron=RowPar("self_attention.linear_proj.weight"),
                    vllm=RowPar(vllm + "o_proj.weight")))
    rows.append(Row("self_attn.o_proj.bias", ("H",), megatron=Rep("self_attention.linear_proj.bias"),
                    vllm=Rep(vllm + "o_proj.bias"), when="o_bias"))
    rows.append(Row("self_attn.q_norm.weight", ("D",), megatron=Rep("self_attention.q_layernorm.weight"),
                    vllm=Rep(vllm + "q_norm.weight"), when="qk_norm"))
    rows.append(Row("self_attn.k_norm.weight", ("D",), megatron=Rep("self_attention.k_layernorm.weight"),
                    vllm=Rep(vllm + "k_norm.weight"), when="qk_norm"))
    if sinks:  # one learned logit per head (megatron: softmax_type="learnable"), split by heads
        rows.append(Row("self_attn.sinks", ("heads",), megatron=Col("self_attention.core_attention.softmax_offset"),
                        vllm=Col(vllm + "sinks")))
    return tuple(rows)


def post_attention_norm(*, dense: bool) -> Row:
    """``post_attention_layernorm``: megatron's ``pre_mlp_layernorm`` (a dense MLP's is fused
    into ``linear_fc1`` in the TE spec; a MoE layer keeps it separate in both specs)."""
    te = Rep("mlp.linear_fc1.layer_norm_weight") if dense else None
    return Row("post_attention_layernorm.weight", ("H",), megatron=Rep("pre_mlp_layernorm.weight", te=te),
               vllm=Rep("post_attention_layernorm.weight"))


def dense_mlp() -> tuple[Row, ...]:
    """The norm and a SwiGLU MLP: ``[gate_r; up_r]`` on both sides, down row-parallel."""
    return (post_attention_norm(dense=True),
            Row("mlp.gate_proj.weight", ("F", "H"), megatron=Col("mlp.linear_fc1.weight"), vllm=Col("mlp.gate_up_proj.weight")),
            Row("mlp.up_proj.weight", ("F", "H"), megatron=Col("mlp.linear_fc1.weight"), vllm=Col("mlp.gate_up_proj.weight")),
            Row("mlp.down_proj.weight", ("H", "F"), megatron=RowPar("mlp.linear_fc2.weight"),
                vllm=RowPar("mlp.down_proj.weight")))


def moe_router() -> tuple[Row, ...]:
    """A MoE layer's norm, router and (``router_bias``) the aux-loss-free balancing bias,
    fp32 on both sides (megatron's persistent ``expert_bias`` buffer; vLLM builds it fp32)."""
    return (post_attention_norm(dense=False),
            Row("mlp.gate.weight", ("E", "H"), megatron=Rep("mlp.router.weight"), vllm=Rep("mlp.gate.weight")),
            Row("mlp.gate.e_score_correction_bias", ("E",), megatron=Rep("mlp.router.expert_bias"),
                vllm=Rep("mlp.gate.e_score_correction_bias"), dtype="float32", when="router_bias"))


def routed_experts() -> tuple[Row, ...]:
    """One routed expert's SwiGLU (``{e}``): megatron's local expert ``linear_fc1`` =
    ``[gate_r; up_r]`` over expert-TP, vLLM's FusedMoE slot ``w13`` the same over MoE-TP."""
    e = "mlp.experts.{e}."
    return (Row(e + "gate_proj.weight", ("FE", "H"), megatron=Col("linear_fc1.weight"), vllm=Col("w13_weight")),
            Row(e + "up_proj.weight", ("FE", "H"), megatron=Col("linear_fc1.weight"), vllm=Col("w13_weight")),
            Row(e + "down_proj.weight", ("H", "FE"), megatron=RowPar("linear_fc2.weight"), vllm=RowPar("w2_weight")))


def shared_experts() -> tuple[Row, ...]:
    """The shared expert: a SwiGLU MLP on the dense TP group (``shared``)."""
    s = "mlp.shared_experts."
    return (Row(s + "gate_proj.weight", ("S", "H"), megatron=Col(s + "linear_fc1.weight"),
                vllm=Col(s + "gate_up_proj.weight"), when="shared"),
            Row(s + "up_proj.weight", ("S", "H"), megatron=Col(s + "linear_fc1.weight"),
                vllm=Col(s + "gate_up_proj.weight"), when="shared"),
            Row(s + "down_proj.weight", ("H", "S"), megatron=RowPar(s + "linear_fc2.weight"),
                vllm=RowPar(s + "down_proj.weight"), when="shared"))


def embedding(vllm: str = "model.embed_tokens.weight") -> tuple[Row, ...]:
    """The input embedding (first pipeline stage), vocab rows padded by each library's rule."""
    return (Row("model.embed_tokens.weight", ("V", "H"), megatron=Vocab("embedding.word_embeddings.weight"),
                vllm=Vocab(vllm)),)


def final() -> tuple[Row, ...]:
    """The final norm and, unless tied to the embedding, the output head (last stage)."""
    return (Row("model.norm.weight", ("H",), megatron=Rep("decoder.final_layernorm.weight"), vllm=Rep("model.norm.weight")),
            Row("lm_head.weight", ("V", "H"), megatron=Vocab("output_layer.weight"), vllm=Vocab("lm_head.weight"),
                when="!tied"))


def language_model(rows: tuple[Row, ...], hf: Callable[[str], str] = lambda name: name) -> tuple[Row, ...]:
    """A vision-language model's language-model rows outside its layers (``embedding()``,
    ``final()``): vLLM holds them under ``language_model.``; ``hf`` renames the checkpoint's
    (megatron's prefix is ``Family.megatron_prefix``)."""
    return tuple(replace(r, hf=hf(r.hf), vllm=replace(r.vllm, name="language_model." + r.vllm.name)) for r in rows)
