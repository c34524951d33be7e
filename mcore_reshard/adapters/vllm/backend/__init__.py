"""The ``mcore_reshard`` weight-transfer backend: both of vLLM's ends of it, together, as vLLM's own
backends keep theirs (``nccl_engine.py``; ``m2n_engine`` / ``m2n_trainer``).

- the engine end, ``ReshardWeightTransferEngine`` (vLLM's ``WeightTransferEngine``, in every
  worker), with its init and update info (``wire.protocol.EngineInitInfo`` / ``EngineUpdateInfo``);
- the trainer end, ``ReshardTrainerEngine`` (vLLM's ``TrainerWeightTransferEngine``, in every
  training rank), with its ``ReshardTrainerInitInfo`` and ``TrainerShards`` source, driving the
  engine through vLLM's weight-sync client as a refit destination (``client.WeightSyncClient``).

``adapters.vllm.plugin`` registers both with vLLM's factories by class.
"""

from __future__ import annotations

from ....wire.protocol import BACKEND
from ..weight_transfer import ReshardWeightTransferEngine
from .client import WeightSyncClient
from .trainer import ReshardTrainerEngine, ReshardTrainerInitInfo, TrainerShards

__all__ = ["BACKEND", "ReshardWeightTransferEngine", "ReshardTrainerEngine", "ReshardTrainerInitInfo",
           "TrainerShards", "WeightSyncClient"]
