"""The DeepSeek-V3 family (``DeepseekV3ForCausalLM``: DeepSeek-V3, Kimi-K2, Moonlight):
multi-head latent attention, dense first layers, MoE with a shared expert and a sigmoid router
whose ``e_score_correction_bias`` both libraries keep in fp32; MTP layers after the decoder
(``layout.mtp``).

MLA rows: the up-projections are column-parallel by heads on both sides; the down-projections
are column-parallel row chunks in megatron's local spec and whole (``TELinear``
"duplicated") in its TE spec; vLLM fuses ``[q_a_proj; kv_a_proj_with_mqa]`` into one
replicated ``fused_qkv_a_proj`` (with ``q_lora_rank``) or keeps ``q_proj`` column-parallel and
``kv_a_proj_with_mqa`` whole (without). megatron's TE spec fuses ``q_a_layernorm`` /
``kv_a_layernorm`` into the up-projections (``layer_norm_weight``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..family import Block, Col, Family, Rep, Row, RowPar, standard_dims, standard_flags
from .common import dense_mlp, embedding, final, moe_router, routed_experts, shared_experts

__all__ = ["DEEPSEEK_V3", "TINY_DEEPSEEK_V3", "MLA"]

#: DeepSeek-V3 shaped: MLA with q_lora (set ``q_lora_rank=None`` for a plain q_proj), one dense
#: first layer, then MoE layers with a shared expert and a sigmoid router with
#: e_score_correction_bias. vLLM's CPU MLA kernel compiles only for kv_lora_rank 512 + rope 64;
#: one expert group (megatron and HF score groups differently).
TINY_DEEPSEEK_V3: dict[str, Any] = dict(
    architectures=["DeepseekV3ForCausalLM"],
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=512,
    qk_nope_head_dim=32,
    qk_rope_head_dim=64,
    v_head_dim=32,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    n_group=1,
    topk_group=1,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    num_nextn_predict_layers=0,
    vocab_size=1000,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rope_scaling=None,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

@dataclass(frozen=True, slots=True)
class MLA:
    """Multi-head latent attention sizes (DeepSeek-V2/V3), in the HF config's names.

    ``q_lora_rank`` None: queries come from one ``q_proj`` instead of ``q_a_proj`` ->
    ``q_a_layernorm`` -> ``q_b_proj`` (Moonlight, DeepSeek-V2-Lite).
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


_SA = "self_attention."


def _mla_rows() -> tuple[Row, ...]:
    a = "self_attn."
    fused = Rep(a + "fused_qkv_a_proj.weight")
    return (
        Row("input_layernorm.weight", ("H",), megatron=Rep("input_layernorm.weight"), vllm=Rep("input_layernorm.weight")),
        Row(a + "q_proj.weight", ("QK", "H"), megatron=Col(_SA + "linear_q_proj.weight"), vllm=Col(a + "q_proj.weight"),
            when="!q_lora"),
        Row(a + "q_a_proj.weight", ("QL", "H"),
            megatron=Col(_SA + "linear_q_down_proj.weight", te=Rep(_SA + "linear_q_down_proj.weight")),
            vllm=fused, when="q_lora"),
        Row(a + "q_a_layernorm.weight", ("QL",),
            megatron=Rep(_SA + "q_layernorm.weight", te=Rep(_SA + "linear_q_up_proj.layer_norm_weight")),
            vllm=Rep(a + "q_a_layernorm.weight"), when="q_lora"),
        Row(a + "q_b_proj.weight", ("QK", "QL"), megatron=Col(_SA + "linear_q_up_proj.weight"),
            vllm=Col(a + "q_b_proj.weight"), when="q_lora"),
        Row(a + "kv_a_proj_with_mqa.weight", ("KVA", "H"),
            megatron=Col(_SA + "linear_kv_down_proj.weight", te=Rep(_SA + "linear_kv_down_proj.weight")),
            vllm=fused, when="q_lora"),
        Row(a + "kv_a_proj_with_mqa.weight", ("KVA", "H"),
            megatron=Col(_SA + "linear_kv_down_proj.weight", te=Rep(_SA + "linear_kv_down_proj.weight")),
            vllm=Rep(a + "kv_a_proj_with_mqa.weight"), when="!q_lora"),
        Row(a + "kv_a_layernorm.weight", ("KVL",),
            megatron=Rep(_SA + "kv_layernorm.weight", te=Rep(_SA + "linear_kv_up_proj.layer_norm_weight")),
            vllm=Rep(a + "kv_a_layernorm.weight")),
        Row(a + "kv_b_proj.weight", ("KVB", "KVL"), megatron=Col(_SA + "linear_kv_up_proj.weight"),
            vllm=Col(a + "kv_b_proj.weight")),
        Row(a + "o_proj.weight", ("H", "OV"), megatron=RowPar(_SA + "linear_proj.weight"),
            vllm=RowPar(a + "o_proj.weight")),
    )


def _dims(spec: Any) -> dict[str, int]:
    m, nH = spec.mla, spec.num_heads
    return {**standard_dims(spec), "QL": m.q_lora_rank or 0, "KVL": m.kv_lora_rank,
            "KVA": m.kv_lora_rank + m.qk_rope_head_dim, "QK": nH * m.qk_head_dim,
            "KVB": nH * (m.qk_nope_head_dim + m.v_head_dim), "OV": nH * m.v_head_dim}


def _flags(spec: Any) -> frozenset[str]:
    return standard_flags(spec) | ({"q_lora"} if spec.mla.q_lora_rank else set())


def _read(cfg: Mapping[str, Any]) -> dict[str, Any]:
    mla = MLA(q_lora_rank=int(cfg["q_lora_rank"]) if cfg.get("q_lora_rank") else None,
              kv_lora_rank=int(cfg["kv_lora_rank"]), qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
              qk_rope_head_dim=int(cfg["qk_rope_head_dim"]), v_head_dim=int(cfg["v_head_dim"]))
    L, nH = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
    E = int(cfg.get("n_routed_experts") or 0)
    F_moe = int(cfg.get("moe_intermediate_size") or 0)
    # vLLM's DeepseekV2DecoderLayer rule (transformers 5 ignores moe_layer_freq; every
    # published config has 1, where the two agree).
    first, freq = int(cfg.get("first_k_dense_replace") or 0), int(cfg.get("moe_layer_freq") or 1)
    return dict(mla=mla, num_kv_heads=nH, head_dim=mla.qk_head_dim,  # MLA has no KV heads; D names the q width
                num_experts=E, moe_intermediate=F_moe, moe_topk=int(cfg.get("num_experts_per_tok") or 0),
                moe_layers=tuple(i for i in range(L) if E > 0 and i >= first and i % freq == 0),
                shared_intermediate=F_moe * int(cfg.get("n_shared_experts") or 0),
                router_bias=cfg.get("topk_method") == "noaux_tc", mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0))


def _layers(spec: Any, layer: int) -> tuple[str, ...]:
    return ("attention", "moe", "experts", "shared") if spec.is_moe(layer) else ("attention", "mlp")


def megatron_config(spec: Any) -> dict[str, Any]:
    """MLA and DeepSeek-V3 router settings from the HF config (``MLATransformerConfig``).

    Plain RoPE only (HF ``rope_scaling`` null): megatron's MLA de-interleaves the rope dims as
    HF's ``rope_interleave`` does. Routing as HF's ``DeepseekV3TopkRouter``: sigmoid scores,
    top-k on scores + bias, weights renormalised then scaled; group-limited routing only with
    one group (megatron scores a group by its top ``topk/group_topk`` experts, HF by its top 2).
    """
    m, hf = spec.mla, spec.hf_config
    if (hf.get("rope_scaling") or {}).get("type", "default") not in ("default",):
        raise ValueError("the CPU build supports DeepSeek-V3 with plain RoPE only (rope_scaling null)")
    kw: dict[str, Any] = dict(
        multi_latent_attention=True,
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_head_dim=m.qk_nope_head_dim,
        qk_pos_emb_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        rope_type="rope",
        rotary_scaling_factor=1.0,
    )
    if spec.moe_layers:
        if int(hf.get("n_group") or 1) != 1:
            raise ValueError("the CPU build supports n_group=1 only (megatron and HF score groups differently)")
        kw.update(
            moe_router_score_function=str(hf.get("scoring_func", "sigmoid")),
            moe_router_enable_expert_bias=spec.router_bias,
            moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            moe_shared_expert_intermediate_size=spec.shared_intermediate or None,
        )
    return kw


DEEPSEEK_V3 = Family(
    name="deepseek_v3", title="DeepSeek-V3", architectures=("DeepseekV3ForCausalLM",),
    model_types=("deepseek_v3", "kimi_k2"), read=_read,
    blocks={"attention": Block(_mla_rows()), "mlp": Block(dense_mlp()), "moe": Block(moe_router()),
            "experts": Block(routed_experts(), experts=True), "shared": Block(shared_experts())},
    layers=_layers, pre=embedding(), post=final(), dims=_dims, flags=_flags, megatron_config=megatron_config,
    tiny=TINY_DEEPSEEK_V3,
)
