"""A DTensor policy built as NeMo RL's DTensor backend builds one (tests and benchmarks): the
project's own builder (``adapters.dtensor.policy``) by (checkpoint, dp, tp)."""

from __future__ import annotations

from typing import Any

from ..adapters.dtensor.parallel import TP_PLAN, DTensorParallel
from ..adapters.dtensor.policy import build_dtensor_model

__all__ = ["TP_PLAN", "build_dtensor_policy"]


def build_dtensor_policy(ckpt: str, dp: int, tp: int) -> Any:
    """The HF model of ``ckpt`` (fp32), TP over "tp", FSDP2 over "dp"."""
    return build_dtensor_model(ckpt, DTensorParallel(dp=dp, tp=tp))
