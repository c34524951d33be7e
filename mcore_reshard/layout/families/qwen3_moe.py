"""Qwen3-MoE (``Qwen3MoeForCausalLM``): GQA with qk-norm, routed experts (no shared expert),
dense layers where ``mlp_only_layers`` or ``decoder_sparse_step`` say so."""

from __future__ import annotations

from typing import Any, Mapping

from ..family import Block, Family
from .common import embedding, final, moe_router, routed_experts
from .dense import DENSE_BLOCKS, TINY_QWEN3

__all__ = ["QWEN3_MOE", "TINY_QWEN3_MOE", "MOE_BLOCKS"]

#: The blocks of a MoE layer without a shared expert (router, then the routed experts).
MOE_BLOCKS = {"moe": Block(moe_router()), "experts": Block(routed_experts(), experts=True)}

TINY_QWEN3_MOE: dict[str, Any] = dict(
    TINY_QWEN3,
    architectures=["Qwen3MoeForCausalLM"],
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
)


def _read(cfg: Mapping[str, Any]) -> dict[str, Any]:
    L = int(cfg["num_hidden_layers"])
    E = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)  # transformers 5 renamed it
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    only = set(cfg.get("mlp_only_layers") or [])
    return dict(qkv_bias=bool(cfg.get("attention_bias", False)), qk_norm=True, num_experts=E,
                moe_intermediate=int(cfg["moe_intermediate_size"]), moe_topk=int(cfg.get("num_experts_per_tok", 0)),
                moe_layers=tuple(i for i in range(L) if i not in only and E > 0 and (i + 1) % step == 0))


def _layers(spec: Any, layer: int) -> tuple[str, ...]:
    return ("attention", "moe", "experts") if spec.is_moe(layer) else ("attention", "mlp")


QWEN3_MOE = Family(
    name="qwen3_moe", title="Qwen3-MoE", architectures=("Qwen3MoeForCausalLM",), model_types=("qwen3_moe",), read=_read,
    blocks={**DENSE_BLOCKS, **MOE_BLOCKS}, layers=_layers, pre=embedding(), post=final(),
    vllm_top_on_every_stage=True, tiny=TINY_QWEN3_MOE,
)
