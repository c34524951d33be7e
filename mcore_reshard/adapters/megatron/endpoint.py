"""The training end of a refit, created inside a framework's own Megatron-Core rank.

Nothing here assumes this project started the process: a framework builds the endpoint from
the model chunks it already holds (wrapped in ``Float16Module`` / DDP or not) after megatron's
``parallel_state`` is initialised, and calls it from its own control loop::

    ep = TrainerEndpoint(model_chunks, spec, sync_params=policy.sync_params)
    params = ep.describe()                         # -> the driver plans with every rank's list
    ep.join(JoinInfo(...))                         # once per refit group
    ep.set_plan(slice_wire, plan_digest)           # once per layout
    report = ep.refit(RefitRequest(plan_digest))   # every step; raises RefitFailed if any rank failed
    ep.leave()

``refit`` moves this rank's boxes, then votes with every other rank of the refit group (all
trainers and every engine's workers): all commit or none does, and the votes carry every
rank's ``RankReport`` (``last_reports``), which is how the inference side reports back.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from ...layout import LayoutError, LocalParam, ModelSpec
from ...wire.protocol import JoinInfo, RankReport, RefitRequest
from ...transport.participant import IN_PLACE, Outcome, RefitEndpoint
from ...transport.injection import ExitAfterReads
from ...wire.faults import Fault
from .live import _unwrap, describe, named_local_params
from .lora import policy_peft

__all__ = ["TrainerEndpoint", "sync_params_before_refit"]


def sync_params_before_refit(chunks: Sequence[Any]) -> None:
    """With the distributed optimizer and an overlapped param all-gather, bf16 params are only
    whole after the gather: force it before reading them (no-op for unwrapped models)."""
    for chunk in chunks:
        sync = getattr(chunk, "start_param_sync", None)
        if callable(sync):
            sync(force_sync=True)


class TrainerEndpoint:
    """One training rank's end of the refit protocol (see the module docstring)."""

    def __init__(self, model_chunks: Sequence[Any], spec: ModelSpec, *, rank: int | None = None,
                 sync_params: Callable[[], None] | None = None, device: str = "cpu") -> None:
        import torch.distributed as dist

        self.chunks = list(model_chunks)
        self.spec = spec
        self.rank = dist.get_rank() if rank is None else rank
        self._sync = sync_params or (lambda: sync_params_before_refit(self.chunks))
        self._endpoint = RefitEndpoint("src", self.rank, device)
        self._params: list[LocalParam] | None = None
        #: Every rank's report of the last refit, by refit-group rank (None: no vote).
        self.last_reports: list[RankReport | None] = []
        self.last_outcome: Outcome | None = None

    def describe(self) -> list[LocalParam]:
        """This rank's pieces, predicted by the rules and checked name by name against the
        live model (``live.describe``); cached."""
        if self._params is None:
            self._params = describe(self.chunks, self.spec)
        return self._params

    def join(self, info: JoinInfo) -> int:
        return self._endpoint.join(info)

    def set_plan(self, slice_wire: Mapping[str, Any], plan_digest: str) -> str:
        """Keep this rank's slice; a LoRA policy first checks the scaling the plan sends its B
        with against its own ``alpha / r`` (the engine folds the plan's into its slots)."""
        return self._endpoint.set_plan(slice_wire, plan_digest, check=self._check_scale)

    def _check_scale(self, rank_plan: Any) -> None:
        peft = policy_peft(_unwrap(self.chunks[0]))
        scale = rank_plan.get("lora")
        for name, factor in (scale.locals if scale is not None else ()):
            if peft is None or abs(factor - peft.scaling) > 1e-12 * peft.scaling:
                mine = "no adapters" if peft is None else f"peft.alpha={peft.alpha:g}, peft.dim={peft.dim}"
                raise LayoutError(f"training rank {self.rank}: the plan scales {name} by {factor:g} (the engine's "
                                  f"alpha / r); this policy has {mine}")

    def local_tensors(self) -> dict[str, Any]:
        """The live local parameters by descriptor name (read, never copied) -- but for a
        parameter the family's table carries wider than megatron holds it (``widened``:
        GLM-4.5's router weight, fp32 as vLLM holds it): a widened copy, made per refit."""
        import torch

        wide = {lp.name: lp.dtype for lp in self.describe()}
        out = {}
        for name, p in named_local_params(self.chunks).items():
            want = wide.get(name)
            held = str(p.dtype).removeprefix("torch.")
            out[name] = p.data if want is None or held == want else p.data.to(getattr(torch, want))
        return out

    def refit(self, request: RefitRequest, progress: bool = False, fault: Fault | None = None,
              die_after_reads: int | None = None, raise_after_reads: int | None = None) -> RankReport:
        """Send this rank's boxes, vote, and return this rank's report. Raises ``RefitFailed``
        naming every failing rank of either side when the refit did not commit. Fault
        injection for tests: ``fault`` (``transport.injection.Fault``); ``die_after_reads``: this
        rank's process exits abruptly at its n-th read of a local tensor (dying mid-refit);
        ``raise_after_reads``: that read raises instead (a failure mid-transfer)."""
        self._sync()
        tensors: Mapping[str, Any] = self.local_tensors()
        if die_after_reads is not None:
            tensors = ExitAfterReads(tensors, die_after_reads)
        elif raise_after_reads is not None:
            tensors = ExitAfterReads(tensors, raise_after_reads, raises=True)
        outcome, report = self._endpoint.refit(request, tensors, None, IN_PLACE, progress=progress, fault=fault)
        self.last_outcome, self.last_reports = outcome, outcome.reports
        outcome.raise_if_failed()
        return report

    def raw_bandwidth(self, pairs: list[tuple[int, int]], nbytes: int, timeout_s: float) -> float | None:
        return self._endpoint.raw_bandwidth(pairs, nbytes, timeout_s)

    @property
    def group(self):
        """The refit group (the HF baseline gathers over it)."""
        return self._endpoint.group

    def leave(self) -> None:
        self._endpoint.leave()
