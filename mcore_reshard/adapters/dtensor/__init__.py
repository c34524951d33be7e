"""Training ranks whose parameters are torch ``DTensor``s: PyTorch FSDP2 (``fully_shard``),
tensor parallelism through ``parallelize_module``, or both on one mesh (NeMo RL's DTensor
policy). The adapter reads each parameter's mesh and placements; it knows no model beyond the
HF names of its parameters."""

from .source import DTensorEndpoint, dtensor_params

__all__ = ["DTensorEndpoint", "dtensor_params"]
