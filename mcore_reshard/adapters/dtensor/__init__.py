"""Training ranks whose parameters are torch ``DTensor``s: PyTorch FSDP2 (``fully_shard``),
tensor parallelism through ``parallelize_module``, or both on one mesh (NeMo RL's DTensor
policy). The adapter reads each parameter's mesh and placements; it knows no model beyond the
HF names of its parameters. ``parallel`` (the mesh's sizes) imports no torch; the rest on use."""

from __future__ import annotations

from typing import Any

from .parallel import DTensorParallel

__all__ = ["DTensorEndpoint", "DTensorParallel", "dtensor_params"]


def __getattr__(name: str) -> Any:
    if name in ("DTensorEndpoint", "dtensor_params"):
        from . import source

        return getattr(source, name)
    raise AttributeError(name)
