"""Megatron-Core side: layout rules (metadata only) and the live adapter (imports megatron lazily)."""

from .rules import MegatronParallel, megatron_layout, megatron_rank_params

__all__ = ["MegatronParallel", "megatron_layout", "megatron_rank_params"]
