"""Megatron-Core side: layout rules (metadata only), the CPU runtime, a tiny-model builder with
a multi-process harness, and the live adapter. Importing the package imports neither torch nor
megatron: those are imported inside the functions that need them."""

from .build import build_gpt, init_megatron, megatron_config
from .live import describe, describe_world, live_parallel, named_local_params
from .rules import (
    TIED_OUTPUT_NOTE,
    MegatronParallel,
    megatron_layout,
    megatron_rank_params,
    padded_vocab,
    rank_coords,
    stage_layers,
)
from .runtime import apply_cpu_patches

__all__ = [
    "MegatronParallel",
    "megatron_layout",
    "megatron_rank_params",
    "padded_vocab",
    "rank_coords",
    "stage_layers",
    "TIED_OUTPUT_NOTE",
    "apply_cpu_patches",
    "init_megatron",
    "build_gpt",
    "megatron_config",
    "describe",
    "describe_world",
    "live_parallel",
    "named_local_params",
]
