"""vLLM general plugin: registers the ``mcore_reshard`` weight-transfer backend -- both its ends
(``backend``: the engine end in every worker, the trainer end for vLLM's trainer-side factory)
-- and installs the hooks the backend needs in every vLLM process (``fast_start``,
``session``) and the readers' spin where a job sets it (``spin``).

Declared as a ``vllm.general_plugins`` entry point in ``pyproject.toml``, so vLLM runs it in
every process it starts (the registry is per process: the workers need it, not the driver).
Importing this module imports nothing heavy; ``register`` imports the backend, by class.
"""

from __future__ import annotations

from ...wire.protocol import BACKEND

__all__ = ["BACKEND", "register"]


def register() -> None:
    """Idempotent: vLLM may load general plugins more than once per process."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    from . import fast_start, session, spin
    from .backend import ReshardTrainerEngine, ReshardWeightTransferEngine

    for factory, end in ((WeightTransferEngineFactory, ReshardWeightTransferEngine),
                         (WeightTransferTrainerFactory, ReshardTrainerEngine)):
        try:
            factory.register_engine(BACKEND, end)
        except ValueError:  # vLLM's answer to a second registration of the name (no public lookup)
            pass
    fast_start.install()
    session.install()
    spin.install()
