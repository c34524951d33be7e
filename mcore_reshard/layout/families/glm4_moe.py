"""GLM-4.5 (``Glm4MoeForCausalLM``: GLM-4.5, GLM-4.5-Air): GQA attention with q/k/v biases and
optional qk-norm, partial RoPE (no tensor of its own), dense first layers
(``first_k_dense_replace``), then MoE layers with a shared expert and a sigmoid router whose
``e_score_correction_bias`` both libraries keep in fp32, as DeepSeek-V3's; an MTP layer after
the decoder (``num_nextn_predict_layers``) that vLLM's main model does not load.

vLLM builds the router's weight in fp32 (``GateLinear(params_dtype=torch.float32)``), so the
table carries it in fp32: megatron-core holds it in the model's dtype, and a bf16 policy's
trainers widen it when they send it (exact; ``Placement.widened``), 2 bytes more per element of
one ``(E, H)`` matrix per MoE layer.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..family import Block, Family, Rep, Row
from .common import dense_mlp, embedding, final, gqa_attention, post_attention_norm, routed_experts, shared_experts

__all__ = ["GLM4_MOE", "TINY_GLM4_MOE"]

#: GLM-4.5 shaped: one dense first layer, then MoE layers (8 experts top-2, a shared expert),
#: GQA P = 4 with q/k/v biases and qk-norm, half the head dims rotated.
TINY_GLM4_MOE: dict[str, Any] = dict(
    architectures=["Glm4MoeForCausalLM"],
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    use_qk_norm=True,
    attention_bias=True,
    partial_rotary_factor=0.5,
    num_nextn_predict_layers=0,
    vocab_size=1000,
    max_position_embeddings=512,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def _router() -> tuple[Row, ...]:
    return (post_attention_norm(dense=False),
            Row("mlp.gate.weight", ("E", "H"), megatron=Rep("mlp.router.weight", widened=True),
                vllm=Rep("mlp.gate.weight"), dtype="float32"),
            Row("mlp.gate.e_score_correction_bias", ("E",), megatron=Rep("mlp.router.expert_bias"),
                vllm=Rep("mlp.gate.e_score_correction_bias"), dtype="float32"))


def _read(cfg: Mapping[str, Any]) -> dict[str, Any]:
    L = int(cfg["num_hidden_layers"])
    E = int(cfg.get("n_routed_experts") or 0)
    F = int(cfg.get("moe_intermediate_size") or 0)
    first = int(cfg.get("first_k_dense_replace") or 0)
    return dict(qkv_bias=bool(cfg.get("attention_bias", False)), qk_norm=bool(cfg.get("use_qk_norm", False)),
                num_experts=E, moe_intermediate=F, moe_topk=int(cfg.get("num_experts_per_tok") or 0),
                moe_layers=tuple(i for i in range(L) if E > 0 and i >= first),
                shared_intermediate=F * int(cfg.get("n_shared_experts") or 0), router_bias=True,
                mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0))


def _layers(spec: Any, layer: int) -> tuple[str, ...]:
    return ("attention", "moe", "experts", "shared") if spec.is_moe(layer) else ("attention", "mlp")


def megatron_config(spec: Any) -> dict[str, Any]:
    """megatron-core 0.19's GLM-4.5: q/k/v biases only, qk-norm, ``rotary_percent`` =
    ``partial_rotary_factor``, routing as HF's ``Glm4MoeTopkRouter`` (sigmoid scores, top-k
    on scores + bias, renormalised, scaled) with one expert group, a shared expert."""
    hf = spec.hf_config
    rope = dict(hf.get("rope_parameters") or {})
    partial = float(hf.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 0.5)
    if int(hf.get("n_group") or 1) != 1:
        raise ValueError("the CPU build supports n_group=1 only (megatron and HF score groups differently)")
    return dict(add_qkv_bias=spec.qkv_bias, rotary_percent=partial, moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True,
                moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                moe_shared_expert_intermediate_size=spec.shared_intermediate or None)


GLM4_MOE = Family(
    name="glm4_moe", title="GLM-4.5", architectures=("Glm4MoeForCausalLM",), model_types=("glm4_moe",), read=_read,
    blocks={"attention": Block(gqa_attention()), "mlp": Block(dense_mlp()), "moe": Block(_router()),
            "experts": Block(routed_experts(), experts=True), "shared": Block(shared_experts())},
    layers=_layers, pre=embedding(), post=final(), megatron_config=megatron_config, tiny=TINY_GLM4_MOE,
    notes=("GLM-4.5: mlp.gate.weight travels in fp32 as vLLM holds it; megatron-core holds it in the model dtype "
           "and the trainers send a widened copy",),
)
