"""vLLM side: layout rules (metadata only) and the worker extension (imports vllm lazily)."""

from .rules import VllmParallel, vllm_layout, vllm_rank_params

__all__ = ["VllmParallel", "vllm_layout", "vllm_rank_params"]
