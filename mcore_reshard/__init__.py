"""mcore-reshard: refit Megatron-Core weights into vLLM moving only the bytes each rank holds.

Data path: model -> descriptors (``layout``, ``adapters``) -> plan (``plan``) ->
transport (``transport``) -> vLLM parameters (``adapters.vllm``).
"""

__version__ = "0.1.0"
