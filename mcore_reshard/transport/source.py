"""A training rank's end of a refit, over whatever holds its local shards.

Every training framework's rank runs the same sequence (``RefitEndpoint``, shared with the
engines): join the refit group, keep its slice of the plan, then at each refit send its boxes
and vote. What differs by framework is only how a rank knows what it holds and reads it:
:meth:`SourceEndpoint.describe` (its pieces of the canonical tensors) and
:meth:`SourceEndpoint.local_tensors` (the live local tensors, by the descriptors' names), with
:meth:`SourceEndpoint.sync` run first (a framework whose parameters are only whole after a
gather). Megatron-Core's ranks (``adapters/megatron/endpoint.py``) and DTensor/FSDP2 ranks
(``adapters/dtensor/source.py``) are the two subclasses; vLLM's trainer API takes either
(``adapters/vllm/backend/trainer.TrainerShards``).
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import torch

from ..layout import LocalParam, ModelSpec
from ..wire.faults import Fault
from ..wire.protocol import JoinInfo, RankReport, RefitRequest
from .injection import ExitAfterReads
from .participant import IN_PLACE, Outcome, Participant, RefitEndpoint, TopLogprobs

__all__ = ["SourceEndpoint", "all_gather_json"]


def all_gather_json(value: Any) -> list[Any]:
    """Every trainer rank's ``value`` (JSON), in rank order, over the default process group:
    bytes in a tensor, never a pickle (the trainers' group is a network channel too)."""
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    data = json.dumps(value).encode()
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n)
    width = max(int(s) for s in sizes)
    mine = torch.zeros(width, dtype=torch.uint8, device=device)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    bufs = [torch.zeros(width, dtype=torch.uint8, device=device) for _ in sizes]
    dist.all_gather(bufs, mine)
    return [json.loads(bytes(b[: int(s)].cpu().numpy())) for b, s in zip(bufs, sizes)]


class SourceEndpoint:
    """One training rank's end of the refit protocol (see the module docstring). ``rank`` is
    its rank among the trainers (the default process group's, by default); ``spec`` the model
    its pieces are pieces of; ``canary`` the policy's ``top_logprobs``, which completes a refit's
    deferred canary after this rank's last byte (``RefitEndpoint.meet_canary``; without it such a
    refit is this rank's "no"), ``canary_draft`` its MTP head's ``draft_top_logprobs`` (a canary
    that checks the engines' draft)."""

    def __init__(self, spec: ModelSpec, *, rank: int | None = None, device: str = "cpu",
                 canary: TopLogprobs | None = None, canary_draft: TopLogprobs | None = None) -> None:
        if rank is None:
            import torch.distributed as dist

            rank = dist.get_rank()
        self.spec = spec
        self.rank = rank
        self.canary = canary
        self.canary_draft = canary_draft
        self._endpoint = RefitEndpoint("src", self.rank, device)
        #: Every rank's report of the last refit, by refit-group rank (None: no vote).
        self.last_reports: list[RankReport | None] = []
        self.last_outcome: Outcome | None = None

    # -- what a framework's subclass gives ------------------------------------------------
    def describe(self) -> list[LocalParam]:
        """This rank's pieces of the canonical tensors (the driver plans with every rank's)."""
        raise NotImplementedError

    def local_tensors(self) -> Mapping[str, Any]:
        """The live local tensors by the descriptors' names (read, never copied)."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make the local tensors whole before a refit reads them (default: they are)."""

    def check_plan(self, rank_plan: Any) -> None:
        """Refuse a plan slice this rank cannot send (default: any is fine)."""

    def participant(self) -> Participant:
        """This rank's part of the refit besides sending, asked after :meth:`sync` (default: a
        sender stages nothing, ``IN_PLACE``; one whose ``open`` raises refuses the refit before
        a byte moves -- its "no" vote reaches every rank at once)."""
        return IN_PLACE

    # -- the refit protocol -----------------------------------------------------------------
    def join(self, info: JoinInfo) -> int:
        return self._endpoint.join(info)

    def set_plan(self, slice_wire: Mapping[str, Any], plan_digest: str) -> str:
        """Keep this rank's slice of the plan (checked against its digest and :meth:`check_plan`)."""
        return self._endpoint.set_plan(slice_wire, plan_digest, check=self.check_plan)

    def refit(self, request: RefitRequest, progress: bool = False, fault: Fault | None = None,
              die_after_reads: int | None = None, raise_after_reads: int | None = None) -> RankReport:
        """Send this rank's boxes, vote, and return this rank's report. Raises ``RefitFailed``
        naming every failing rank of either side when the refit did not commit. Fault
        injection for tests: ``fault`` (``transport.injection.Fault``); ``die_after_reads``: this
        rank's process exits abruptly at its n-th read of a local tensor (dying mid-refit);
        ``raise_after_reads``: that read raises instead (a failure mid-transfer)."""
        self.sync()
        tensors: Mapping[str, Any] = self.local_tensors()
        if die_after_reads is not None:
            tensors = ExitAfterReads(tensors, die_after_reads)
        elif raise_after_reads is not None:
            tensors = ExitAfterReads(tensors, raise_after_reads, raises=True)
        outcome, report = self._endpoint.refit(request, tensors, None, self.participant(), progress=progress,
                                               fault=fault, top=self.canary, draft_top=self.canary_draft)
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
