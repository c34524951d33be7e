"""Pure planning: descriptors in, transfer plan out (imports neither megatron nor vllm)."""

from .cache import get_plan, layout_digest
from .extensions import Casts, Colocated, Quantized, Reinterpreted, Relayed
from .planner import build_plan, check_dest, check_sides, index_sources
from .report import PlanReport, plan_report
from .types import PLAN_SCHEMA, Extension, PlanError, PlanExtension, RankPlan, Transfer, TransferPlan

__all__ = [
    "build_plan",
    "check_sides",
    "check_dest",
    "index_sources",
    "get_plan",
    "layout_digest",
    "plan_report",
    "PlanReport",
    "PlanError",
    "RankPlan",
    "Transfer",
    "TransferPlan",
    "Extension",
    "PlanExtension",
    "PLAN_SCHEMA",
    "Casts",
    "Colocated",
    "Quantized",
    "Reinterpreted",
    "Relayed",
]
