"""A DTensor policy's mesh sizes (imports no torch: settings and dry runs read it)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DTensorParallel"]


@dataclass(frozen=True)
class DTensorParallel:
    """NeMo RL's DTensor policy on ``dp * tp`` ranks: an HF model, tensor-parallel over the mesh's
    "tp" dimension (``parallelize_module``, NeMo RL's plan for a Qwen/Llama layer), FSDP2
    (``fully_shard``) over its "dp" dimension. Rank ``r`` is ``(dp, tp) = divmod(r, tp)``."""

    dp: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp
