"""A DTensor policy's mesh sizes (imports no torch: settings and dry runs read it)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DTensorParallel", "TP_PLAN"]

#: NeMo RL's tensor-parallel plan of a Qwen/Llama decoder layer (``parallelize_module``): module ->
#: style. The builder applies it (``policy.build_dtensor_model``), the rules read it (``rules``).
TP_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
           "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
           "mlp.down_proj": "rowwise"}


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
