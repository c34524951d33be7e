"""Megatron-Core 0.19 parameter layouts as pure functions of (model spec, parallel sizes, rank).

INTERFACE FIXED; body to be implemented.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...layout import LocalParam, ModelSpec, SideLayout


@dataclass(frozen=True)
class MegatronParallel:
    """Training-side parallel sizes, as passed to ``initialize_model_parallel`` + TransformerConfig.

    Rank order is megatron's ``tp-cp-ep-dp-pp``: dense rank = tp_r + tp*(cp_r + cp*(dp_r + dp*pp_r));
    expert rank = etp_r + etp*(ep_r + ep*(edp_r + edp*pp_r)).
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None  # None: megatron's default (= tp)
    cp: int = 1
    dp: int = 1  # dense data-parallel size; world = tp * cp * dp * pp
    vpp: int = 1  # virtual pipeline chunks per stage
    first_stage_layers: int | None = None  # num_layers_in_first_pipeline_stage
    last_stage_layers: int | None = None  # num_layers_in_last_pipeline_stage
    make_vocab_size_divisible_by: int = 128
    layer_spec: str = "local"  # "local" | "te"
    experts: str = "sequential"  # "sequential" (local_experts.{i}) | "grouped" (TEGroupedMLP weight{i})
    sequence_parallel: bool = False  # no layout change; recorded for reports


def megatron_rank_params(spec: ModelSpec, par: MegatronParallel, rank: int) -> list[LocalParam]:
    raise NotImplementedError


def megatron_layout(spec: ModelSpec, par: MegatronParallel) -> SideLayout:
    raise NotImplementedError
