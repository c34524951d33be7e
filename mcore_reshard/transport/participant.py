"""What both ends of a refit share: the group, the plan slice, and the commit sequence.

The trainer endpoint (``adapters/megatron/endpoint.py``) and the vLLM weight-transfer engine
(``adapters/vllm/backend/engine.py``) each own one :class:`RefitEndpoint`, which runs the
sequence of every refit once, for both::

    open -> move the bytes -> prepare -> [canary check] -> vote -> commit | abort

Each side brings a :class:`Participant` (what it does around the vote) and, on the inference
side, a sink (where the bytes go). The trainer's participant has nothing to stage
(:data:`IN_PLACE`); vLLM's applier stages into shadows at ``prepare`` and swaps them in at
``commit``. ``transfer_and_vote`` and ``conclude`` are separate so an engine can vote inside vLLM's
``update_weights`` and commit inside ``finish_weight_update``. The slice check,
close-on-failure, the pair lookup of the bandwidth probe and the report format live here too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch

from ..errors import RefitError, RefitFailed
from ..plan.types import RankPlan
from ..plan.wire import slice_from_wire
from ..wire.protocol import Canary, JoinInfo, RankReport, RefitRequest, first_error_line
from .delta import DeltaRun, DeltaState, decide, refit_id
from .executor import TransferOptions, TransferStats, execute_plan, raw_send_bandwidth
from ..wire.faults import Fault
from .group import RefitGroup
from .quantize import as_sent

__all__ = ["RefitEndpoint", "Outcome", "Participant", "Prepared", "InPlace", "IN_PLACE", "TopLogprobs"]

#: A training rank's policy as a deferred canary needs it: per sequence, the most likely token
#: after each prefix and its log-prob (``top_logprobs``: a collective of the trainers' groups).
TopLogprobs = Callable[[list[list[int]]], Sequence[tuple[Sequence[int], Sequence[float]]]]


@dataclass(frozen=True)
class Prepared:
    """What ``Participant.prepare`` reports: seconds per phase of its own, bytes it keeps
    between refits (delta baselines), and bytes it holds beside the served weights until the
    commit (shadows an overlapped refit keeps while the engine serves)."""

    phases: Mapping[str, float] = field(default_factory=dict)
    baseline_bytes: int = 0
    held_bytes: int = 0


class Participant(Protocol):
    """One rank's part of a refit besides moving bytes; :class:`RefitEndpoint` calls it in
    order: ``open`` before any byte moves, ``prepare`` after the last one, then exactly one
    of ``commit`` or ``abort``, as the vote decided.

    ``open`` returns whether this rank can rebuild boxes from what it holds (the baseline a
    delta refit needs) and may raise to refuse the refit (its "no" vote). ``prepare`` makes
    what arrived ready to serve without changing what is served (raises: a "no" vote).
    ``commit`` swaps it in (raises: this rank failed to commit, it says so in the outcome).
    ``abort`` drops it and never raises: what cannot be undone is kept as the participant's
    own state (e.g. a torn streaming refit refuses to serve)."""

    def open(self, request: RefitRequest) -> bool: ...

    def prepare(self) -> Prepared: ...

    def check(self, canary: Canary) -> None:
        """The canary vote (``RefitRequest.canary``, complete): after every rank prepared, what
        this rank would serve is run on the canary; raises (a "no" vote) when it fails. An
        overlapped refit keeps it for its swap instead (the engine serves until then). A rank
        that serves nothing has nothing to check."""

    def commit(self) -> None: ...

    def abort(self, reason: str) -> None: ...


class InPlace:
    """The participant of a rank that stages nothing: a sender reads its live weights, a
    plain tensor sink is written in place. Its part of the commit is the endpoint's own (the
    delta baselines, ``DeltaState.settle``)."""

    def open(self, request: RefitRequest) -> bool:
        return True

    def prepare(self) -> Prepared:
        return Prepared()

    def check(self, canary: Canary) -> None:
        pass

    def commit(self) -> None:
        pass

    def abort(self, reason: str) -> None:
        pass


#: The participant of every sending rank, and of a destination written in place.
IN_PLACE: Participant = InPlace()


@dataclass(frozen=True)
class Outcome:
    """The agreed result of one refit, as this rank read it after the vote.

    ``known`` False: this rank could not read the decision (the store's host died); it did
    not commit, and an engine worker in that state must not serve
    (``adapters/vllm/backend/engine.py``)."""

    commit: bool
    reports: list[RankReport | None]  # by group rank; None where a rank never voted
    errors: list[str]  # "<who>: <first error line>", one per failing or silent rank
    known: bool = True
    epoch: int = 0
    #: This refit's identity (``delta.refit_id``: unique per plan, group and epoch); "" without a group.
    refit: str = ""

    def raise_if_failed(self) -> None:
        if not self.commit:
            head = "refit aborted on every rank: " if self.known else "refit decision unknown on this rank: "
            raise RefitFailed(head + "; ".join(self.errors))


class RefitEndpoint:
    """One rank's end of the refit group (``side`` "src" = training, "dst" = inference)."""

    def __init__(self, side: str, rank: int, device: str | torch.device = "cpu") -> None:
        if side not in ("src", "dst"):
            raise ValueError(f"side must be 'src' or 'dst', got {side!r}")
        self.side, self.rank, self.device = side, rank, torch.device(device)
        self.group: RefitGroup | None = None
        self._slice: RankPlan | None = None
        self._digest: str | None = None
        #: What this rank keeps between refits for delta refits (``delta.py``).
        self.delta = DeltaState()
        #: Why this rank refuses every refit until it is sent a new slice (e.g. a vLLM worker
        #: that does not hold what its slice writes): its vote is "no" with this line.
        self.refusal = ""

    @property
    def slice(self) -> RankPlan | None:
        """This rank's plan slice as ``set_plan`` kept it (None before one), read-only: what a
        destination checks against what it holds (the refit itself runs ``plan_slice``)."""
        return self._slice

    @property
    def who(self) -> str:
        return f"{'training rank' if self.side == 'src' else 'vLLM destination rank'} {self.rank}"

    # -- lifecycle ------------------------------------------------------------------------
    def join(self, info: JoinInfo) -> int:
        """(Re)build this rank's refit group; a previous one (e.g. broken by a failed refit)
        is closed first. Returns this rank's group rank."""
        self.leave()
        me = info.rank_map.group_rank(self.side, self.rank)
        self.group = RefitGroup.create(info.host, info.port, me, info.world_size, info.timeout_s, is_master=me == 0,
                                       device="cuda" if self.device.type == "cuda" else "cpu",
                                       rank_map=info.rank_map, prefix=info.prefix, secret=info.secret,
                                       nonce=info.nonce)
        return me

    def set_plan(self, wire: Mapping[str, Any], plan_digest: str,
                 check: Callable[[RankPlan], None] | None = None) -> str:
        """Keep this rank's slice (sent once per layout; refits then name the plan by digest).
        The slice is decoded and re-hashed here: what this rank runs is provably what the
        driver cut for it. ``check(slice)`` may refuse it (raises) before it is kept."""
        s = slice_from_wire(wire)
        if s.side != self.side or s.rank != self.rank:
            raise RefitError(f"{self.who}: was sent the slice of {s.side} rank {s.rank}")
        if check is not None:
            check(s)
        self._slice, self._digest, self.refusal = s, plan_digest, ""
        return s.digest()

    def plan_slice(self, request: RefitRequest) -> RankPlan:
        if self.group is None:
            raise RefitError(f"{self.who}: refit before joining the refit group")
        if self._digest != request.plan_digest or self._slice is None:
            raise RefitError(f"{self.who}: asked to run plan {request.plan_digest}, holds {self._digest}")
        return self._slice

    def refit(self, request: RefitRequest, src_tensors: Mapping[str, torch.Tensor], sink: Any,
              participant: Participant, *, progress: bool = False, fault: Fault | None = None,
              top: TopLogprobs | None = None,
              draft_top: TopLogprobs | None = None) -> tuple[Outcome, RankReport | None]:
        """One whole refit on this rank: :meth:`transfer_and_vote`, then :meth:`conclude`.
        Returns the concluded outcome and this rank's report."""
        outcome, report = self.transfer_and_vote(request, src_tensors, sink, participant, progress=progress,
                                                 fault=fault, top=top, draft_top=draft_top)
        return self.conclude(outcome, participant), report

    def transfer_and_vote(self, request: RefitRequest, src_tensors: Mapping[str, torch.Tensor], sink: Any,
                          participant: Participant, *, progress: bool = False, fault: Fault | None = None,
                          top: TopLogprobs | None = None,
                          draft_top: TopLogprobs | None = None) -> tuple[Outcome, RankReport | None]:
        """The refit up to its decision: open, move this rank's bytes, prepare, [the canary],
        vote. Nothing served has changed yet (except in a streaming refit, which commits as
        layers complete). Never raises: any failure is this rank's "no" vote, and the outcome
        names it. Returns the outcome and this rank's report (None when it failed before one).

        ``top``: a training rank's policy (its ``top_logprobs``), which fills in a deferred
        canary's targets and reference after this rank's last byte (:meth:`meet_canary`);
        ``draft_top`` its MTP head's (``draft_top_logprobs``), for a canary that checks the draft."""
        report, error = None, None
        try:
            stats = self._run(request, src_tensors, sink, participant, progress, fault)
            ready = participant.prepare()
            phases = dict(ready.phases)
            if request.canary is not None:
                t0 = time.perf_counter()
                canary, phases["canary_reference"] = self.meet_canary(request, top, draft_top, src_tensors)
                participant.check(canary)
                phases["canary"] = time.perf_counter() - t0
            report = self.report(stats, phases)
            report = replace(report, peak_extra_bytes=report.peak_extra_bytes + ready.held_bytes,
                             delta=replace(report.delta, state_bytes=report.delta.state_bytes + ready.baseline_bytes))
        except BaseException as exc:  # noqa: BLE001 - voted on, then kept as the outcome
            error = exc
        return self.vote(request, report, error, fault=fault), report

    def meet_canary(self, request: RefitRequest, top: TopLogprobs | None, draft_top: TopLogprobs | None = None,
                    src_tensors: Mapping[str, torch.Tensor] | None = None) -> tuple[Canary, float]:
        """Every rank staged before any engine runs its canary forward: that forward is a
        collective over an engine's workers, which one that failed must not leave waiting (a
        failed rank's abort ends this wait at once). A deferred canary (``Canary.deferred``) is
        completed here: the training ranks compute the policy's likely tokens and their
        log-probs now -- one forward, a collective of the trainers' own groups, while the
        engines still receive and stage -- and the first of them hands them to every rank in
        this exchange. A refit into an FP8 engine is checked against the policy as sent: while
        the reference runs, the tensors this rank quantized hold their FP8 round trip
        (``quantize.as_sent``, from ``src_tensors``). Returns the complete canary and this
        rank's seconds computing it."""
        canary, mine, seconds = request.canary, "staged", 0.0
        if canary.deferred and self.side == "src":
            if top is None:
                raise RefitError(f"{self.who}: the refit's canary leaves its reference to the trainers, and this rank "
                                 "has no policy to compute it (SourceEndpoint(canary=policy.top_logprobs))")
            if canary.draft and draft_top is None:
                raise RefitError(f"{self.who}: the refit's canary checks the engines' draft, and this rank has no "
                                 "MTP policy to compute its reference with (SourceEndpoint(canary_draft=...))")
            t0 = time.perf_counter()
            seqs = [list(s) for s in canary.tokens]
            sent = self._slice.quantize if self._slice is not None and src_tensors is not None else ()
            with as_sent(src_tensors or {}, sent):
                got = top(seqs)
                draft = draft_top(seqs) if canary.draft else []
            seconds = time.perf_counter() - t0
            if self.rank == 0:
                mine = {"targets": [list(t) for t, _ in got], "reference": [list(lp) for _, lp in got],
                        "draft_targets": [list(t) for t, _ in draft], "draft_reference": [list(lp) for _, lp in draft]}
        values = self.group.control.exchange(mine, request.timeout_s)
        if not canary.deferred:
            return canary, seconds
        sent = [v for v in values if isinstance(v, dict)]
        if len(sent) != 1:
            raise RefitError(f"{self.who}: the canary's reference came from {len(sent)} training ranks, not 1")
        try:
            v = sent[0]
            return canary.completed(list(zip(v["targets"], v["reference"])),
                                    list(zip(v["draft_targets"], v["draft_reference"]))), seconds
        except (KeyError, TypeError, ValueError) as exc:
            raise RefitError(f"{self.who}: the canary's reference is malformed: {first_error_line(exc)}") from exc

    def conclude(self, outcome: Outcome, participant: Participant) -> Outcome:
        """After the vote: the participant commits or aborts, as the decision says. A commit
        that fails here turns this rank's outcome into a failure naming it (the delta
        baselines are then reset: this rank no longer holds what the others do)."""
        if not (outcome.commit and outcome.known):
            head = "aborted" if outcome.known else "decision unknown"
            participant.abort(f"{head}: {'; '.join(outcome.errors)[:500]}")
            return outcome
        try:
            participant.commit()
        except BaseException as exc:  # noqa: BLE001 - this rank failed to commit; it says so
            self.delta.reset()
            return replace(outcome, commit=False, errors=outcome.errors + [f"{self.who}: commit failed: "
                                                                           f"{first_error_line(exc)}"])
        return outcome

    def _run(self, request: RefitRequest, src_tensors: Mapping[str, torch.Tensor], sink: Any,
             participant: Participant, progress: bool, fault: Fault | None) -> TransferStats:
        """Move this rank's bytes. A failure posts the group's abort signal (every other rank
        stops within a poll interval) and leaves the group broken (closed after the vote).

        Before any byte moves every rank agrees on the plan digest and the verify mode, and
        whether this refit sends deltas (``delta.decide``: every rank holds the same committed
        refit). ``participant.open`` says whether this rank can rebuild boxes from what it
        holds (e.g. not a vLLM worker whose repacked layers have no model-format copy yet)."""
        if self.group is not None:
            self.group.control.begin_refit(request.epoch, watch=True)  # before any check: even a refused refit aborts
        baseline = participant.open(request)
        if self.refusal:
            raise RefitError(self.refusal)
        s = self.plan_slice(request)
        src, dst = (s, None) if self.side == "src" else (None, s)
        self.delta.begin()
        if request.delta == "off":
            self.delta.clear()
        offer = self.delta.offer(request.plan_digest) if baseline and request.delta != "off" else None
        exchanged = self.group.control.exchange([request.plan_digest, request.verify.value, offer], request.timeout_s)
        self.group.control.check_values([v[:2] for v in exchanged], "(plan digest, verify)")
        rm = self.group.rank_map
        decision = decide([v[2] for v in exchanged], request.delta, self.refit_id(request),
                          [rm.name_at(r) for r in range(len(exchanged))])
        delta = None if request.delta == "off" else DeltaRun(decision, self.delta, request.delta_state_limit_bytes)
        stats = execute_plan(src, dst, src_tensors, sink, self.group,
                             TransferOptions(request.timeout_s, request.verify, progress, fault, delta, begin=False))
        if delta is None:
            stats = replace(stats, delta=replace(stats.delta, reason=decision.reason))
        return stats

    def vote(self, request: RefitRequest, report: RankReport | None, error: BaseException | None,
             fault: Fault | None = None) -> Outcome:
        """Every rank of the group (both sides, every engine) votes; one decision is written
        before anyone commits, and every rank reads it (``control.py``). Never raises: a rank
        without a group, or one that cannot reach the store, gets a failed outcome. A group
        whose refit failed is closed afterwards (``join`` makes a new one)."""
        if fault is not None:
            fault.hit("before_vote")
        if self.group is None:  # never joined (or already closed): no one to vote with
            why = f"{self.who}: refit without a refit group" + (f" ({first_error_line(error)})" if error else "")
            self.delta.settle(False)
            return Outcome(False, [], [why], known=True, epoch=request.epoch)
        line = "" if error is None else f"{self.who}: {type(error).__name__}: {first_error_line(error)}"
        if error is not None:  # ranks still inside their transfer stop at this signal, not at their timeout
            self.group.control.post_abort(line)
        payload = {"report": report.to_wire() if report is not None else None}
        after_vote = (lambda: fault.hit("after_vote")) if fault is not None else None
        decision = self.group.control.decide(error is None, payload, line, timeout_s=request.timeout_s, after_vote=after_vote)
        reports = [RankReport.from_wire(p["report"]) if p and p.get("report") else None for p in decision.payloads]
        outcome = Outcome(decision.commit, reports, list(decision.errors), decision.known, self.group.control.epoch,
                          self.refit_id(request))
        self.delta.settle(outcome.commit and outcome.known)
        if fault is not None:
            fault.hit("after_decision")
        if not outcome.commit:
            self.leave()
        return outcome

    def refit_id(self, request: RefitRequest) -> str:
        """The current refit's identity on this group (``delta.refit_id``)."""
        return refit_id(request.plan_digest, self.group.control.nonce, self.group.control.epoch)

    def report(self, stats: TransferStats, phases: Mapping[str, float] | None = None) -> RankReport:
        return RankReport(self.side, self.rank, stats.bytes_sent, stats.bytes_received, stats.messages,
                          stats.buckets, stats.seconds, stats.peak_extra_bytes, stats.verified,
                          {"pack": stats.pack_s, "wire": stats.wire_s, "unpack": stats.unpack_s,
                           "verify": stats.verify_s, **({"quantize": stats.quantize_s} if stats.quantize_s else {}),
                           **(phases or {})}, stats.bytes_same_device,
                          stats.bytes_zero_copy, stats.bytes_full, stats.bytes_headers, stats.delta)

    def raw_bandwidth(self, pairs: list[tuple[int, int]], nbytes: int, timeout_s: float) -> float | None:
        """Benchmark floor: one ``nbytes`` message per (source, destination) group-rank pair;
        bytes/s of this rank's pair, None when it is in none (a rank may be in several
        pairs: each is run in turn, in list order, on both of its ends)."""
        if self.group is None:
            raise RefitError(f"{self.who}: raw_bandwidth before joining the refit group")
        mine = [(s, d) for s, d in pairs if self.group.rank in (s, d)]
        rates = [raw_send_bandwidth(self.group, s, d, nbytes, timeout_s) for s, d in mine]
        return min(rates) if rates else None

    def leave(self) -> None:
        if self.group is not None:
            self.group.close(barrier=False)
            self.group = None

