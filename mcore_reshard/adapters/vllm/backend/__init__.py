"""The ``mcore_reshard`` weight-transfer backend: both of vLLM's ends of it, together, as vLLM's own
backends keep theirs (``nccl_engine.py``; ``m2n_engine`` / ``m2n_trainer``).

- the engine end, ``ReshardWeightTransferEngine`` (``engine.py``: vLLM's ``WeightTransferEngine``,
  in every worker), with its init and update info (``wire.protocol.EngineInitInfo`` /
  ``EngineUpdateInfo``) and its parts: ``pieces.py`` (what the worker holds: target, draft,
  LoRA slots), ``slices.py`` (join the group, take and check the plan slice), ``pending.py``
  (the refit between ``update_weights`` and ``finish_weight_update``, overlapped on its own
  thread) and ``standing.py`` (the version held, ``status()``);
- the trainer end, ``ReshardTrainerEngine`` (``trainer.py``: vLLM's
  ``TrainerWeightTransferEngine``, in every training rank), with its ``ReshardTrainerInitInfo``
  and ``TrainerShards`` source, driving the engine through vLLM's weight-sync client as a refit
  destination (``client.WeightSyncClient``).

``adapters.vllm.plugin`` registers both with vLLM's factories by class.
"""

from __future__ import annotations

from ....wire.protocol import BACKEND
from .engine import ReshardWeightTransferEngine
from .client import WeightSyncClient
from .trainer import ReshardTrainerEngine, ReshardTrainerInitInfo, TrainerShards

__all__ = ["BACKEND", "ReshardWeightTransferEngine", "ReshardTrainerEngine", "ReshardTrainerInitInfo",
           "TrainerShards", "WeightSyncClient"]
