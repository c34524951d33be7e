"""vLLM parameter layouts (model format) as pure functions of (model spec, parallel sizes, rank).

INTERFACE FIXED; body to be implemented.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...layout import LocalParam, ModelSpec, SideLayout


@dataclass(frozen=True)
class VllmParallel:
    """Inference-side sizes. Rank order: ((replica*dp + dp_r)*pp + pp_r)*tp + tp_r.

    ``replicas`` are independent engines (each a full dp*pp*tp group, what RL frameworks run);
    ``dp`` is vLLM's own ``data_parallel_size`` inside one engine (attention replicated per DP
    rank, MoE sharded across dp*tp).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    replicas: int = 1
    enable_ep: bool = False
    num_redundant_experts: int = 0
    expert_placement: str = "linear"  # "linear" | "round_robin"
    #: Current EPLB physical->logical expert map per MoE layer (global layer index -> tuple of
    #: logical ids, one per physical slot). None: the initial map [0..E-1] + [i % E for i < R].
    physical_to_logical: tuple[tuple[int, tuple[int, ...]], ...] | None = None
    #: VLLM_PP_LAYER_PARTITION equivalent; None: vLLM's default split.
    pp_partition: tuple[int, ...] | None = None


def vllm_rank_params(spec: ModelSpec, par: VllmParallel, rank: int) -> list[LocalParam]:
    raise NotImplementedError


def vllm_layout(spec: ModelSpec, par: VllmParallel) -> SideLayout:
    raise NotImplementedError
