"""vLLM side: layout rules (metadata only) and the worker extension (imports vllm lazily)."""

from . import hybrid_rules  # noqa: F401  (registers the hybrid families' rules)
from .rules import VllmParallel, vllm_layout, vllm_rank_params

__all__ = ["VllmParallel", "vllm_layout", "vllm_rank_params"]
