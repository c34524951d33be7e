"""vLLM general plugin: registers the ``mcore_reshard`` weight-transfer engine (and its
trainer side, ``refit.trainer_engine``, with vLLM's trainer factory).

Declared as a ``vllm.general_plugins`` entry point in ``pyproject.toml``, so vLLM runs it in
every process it starts (the registry is per process: the workers need it, not the driver).
Importing this module imports nothing heavy; the engine module is loaded lazily.
"""

from __future__ import annotations

__all__ = ["BACKEND", "register"]

BACKEND = "mcore_reshard"


def register() -> None:
    """Idempotent: vLLM may load general plugins more than once per process."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "mcore_reshard.adapters.vllm.weight_transfer", "ReshardWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:  # the trainer side (``refit.trainer_engine``)
        WeightTransferTrainerFactory.register_engine(
            BACKEND, "mcore_reshard.refit.trainer_engine", "ReshardTrainerEngine")
    from . import fast_start, session

    fast_start.install()
    session.install()
