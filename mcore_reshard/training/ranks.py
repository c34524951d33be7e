"""The training side of a refit, as one typed protocol.

A driver talks to a group of training ranks through methods with typed requests and typed
replies (no method names as strings, no positional tuples, nothing unpickled by hand)::

    ranks.describe().wait()              # every rank's pieces
    ranks.join(info).wait()              # once per refit group
    ranks.set_plan(slices, digest)       # once per layout: slices[r] is rank r's plan slice
    ranks.refit(request).wait()          # every refit: a RefitReply per rank
    ranks.leave().wait()

plus the training calls the jobs need (``train_step``, ``logprobs``, ``grpo_step``, ...) and
``run(task)``, which runs a transport's own trainer end (a :class:`RankTask`, e.g. the HF
baseline's gather and broadcast) without the ranks knowing that transport.

Every call starts on every rank at once and returns a :class:`Pending`: ``wait`` gives one reply
per rank in rank order, or raises ``TrainerError`` naming the first rank that failed, died or
missed the deadline. One call is in flight at a time (a driver starts the trainers' part,
drives the engines, then waits for both).

The training side has three names (``docs/architecture.md``): a rank's ``TrainerEndpoint``
(its end of the refit group, ``adapters.megatron.endpoint``), the :class:`TrainerRank` around
it that answers the calls where the rank lives (``pool.MegatronTrainerRank`` adds this
project's policy and its training calls), and the :class:`TrainerGroup` a driver calls, which
implements every method once over one primitive, "send rank r its call and return how to
collect the replies": ``pool.LocalTrainerGroup`` (local processes) and
``grpo.ray_cluster.RayTrainerGroup`` (Ray actors) implement only that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Generic, Mapping, Protocol, Sequence, TypeVar

from ..wire.faults import TrainerFault
from ..layout import LocalParam, ModelSpec
from .losses import GrpoBatch, PgLossSettings
from ..wire.protocol import JoinInfo, RankReport, RefitRequest

__all__ = ["TrainerRank", "TrainerGroup", "RankTask", "RefitReply", "RankCall", "Pending"]

T = TypeVar("T")
R = TypeVar("R", covariant=True)
TokenIds = Sequence[Sequence[int]]


# ------------------------------------------------------------------------ one rank


class RankTask(Protocol[R]):
    """A transport's work on every training rank (runs where the rank lives)."""

    def run(self, rank: "TrainerRank") -> R: ...


@dataclass(frozen=True)
class RefitReply:
    """A training rank's answer to a refit: its report, and on training rank 0 every rank's
    report from the vote (by refit-group rank; None where a rank did not vote)."""

    report: RankReport
    reports: tuple[RankReport | None, ...] = ()


class TrainerRank:
    """One training rank as a driver's typed calls reach it (``call.run(rank)``), around that
    rank's ``TrainerEndpoint``: what a framework's own process or actor holds. It answers the
    refit calls, and is what a transport's trainer end (a :class:`RankTask`) sees of the rank;
    the training calls are this project's policy's (``pool.MegatronTrainerRank``), a framework's
    rank refuses them. ``sync_params``: the optimizer's parameter sync a transport's trainer
    end runs before it reads the weights (default: the endpoint's own)."""

    def __init__(self, endpoint: Any, sync_params: Callable[[], None] | None = None) -> None:
        from ..adapters.megatron.endpoint import sync_params_before_refit

        self.endpoint = endpoint
        self._sync = sync_params or (lambda: sync_params_before_refit(endpoint.chunks))
        self._resources: dict[str, Any] = {}

    # -- what a transport's trainer end sees ----------------------------------------------------
    @property
    def rank(self) -> int:
        """This rank's number in the training world."""
        return int(self.endpoint.rank)

    @property
    def spec(self) -> ModelSpec:
        return self.endpoint.spec

    @property
    def resources(self) -> dict[str, Any]:
        """Objects a transport keeps on this rank between its tasks (by its own key); what is
        still there when the rank's process closes is closed (``close()``) with it."""
        return self._resources

    def refit_group(self) -> Any:
        """The refit group this rank joined (``transport.group.RefitGroup``), or None."""
        return self.endpoint.group

    def synced_tensors(self) -> Mapping[str, Any]:
        """The live local weights by descriptor name, after the optimizer's parameter sync."""
        self._sync()
        return self.endpoint.local_tensors()

    # -- the refit protocol -----------------------------------------------------------------------
    def describe(self) -> list[LocalParam]:
        return self.endpoint.describe()

    def join(self, info: JoinInfo) -> int:
        return self.endpoint.join(info)

    def set_plan(self, slice_wire: Mapping[str, Any], digest: str) -> str:
        return self.endpoint.set_plan(slice_wire, digest)

    def refit(self, request: RefitRequest, fault: TrainerFault | None = None) -> RefitReply:
        """This rank's report, plus every rank's (from the vote) on rank 0. ``fault``: fault
        injection (tests, ``scripts/soak.py``); only rank ``fault.rank`` acts on it."""
        mine = fault if fault is not None and fault.rank == self.rank else None
        report = self.endpoint.refit(request, fault=mine.fault if mine is not None else None,
                                     die_after_reads=mine.die_after_reads if mine is not None else None,
                                     raise_after_reads=mine.raise_after_reads if mine is not None else None)
        return RefitReply(report, tuple(self.endpoint.last_reports) if self.rank == 0 else ())

    def leave(self) -> None:
        self.endpoint.leave()

    def run(self, task: RankTask[T]) -> T:
        """A transport's own trainer end (e.g. the HF baseline's gather and broadcast)."""
        return task.run(self)

    def close(self) -> None:
        self.endpoint.leave()
        while self._resources:
            _, res = self._resources.popitem()
            try:
                res.close()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass

    # -- training: this project's policy only (``pool.MegatronTrainerRank``) -----------------------
    def _trains(self, what: str) -> Any:
        raise TypeError(f"training rank {self.rank} answers refit calls only ({type(self).__name__} around a "
                        f"framework's TrainerEndpoint): {what!r} is a call of this project's policy")

    def train_step(self, token_ids: TokenIds, lr: float | None = None) -> float:
        return self._trains("train_step")

    def logprobs(self, token_ids: TokenIds, version: int | None = None) -> list[list[float]]:
        return self._trains("logprobs")

    def snapshot(self, version: int, keep: Sequence[int]) -> int:
        return self._trains("snapshot")

    def grpo_step(self, token_ids: TokenIds, batch: GrpoBatch, loss: PgLossSettings) -> float:
        return self._trains("grpo_step")

    def reference_logprobs(self, token_ids: TokenIds) -> list[list[float]]:
        return self._trains("reference_logprobs")

    def local_tensors(self) -> dict[str, Any]:
        return self._trains("local_tensors")

    def raw_bandwidth(self, pairs: Sequence[tuple[int, int]], nbytes: int, timeout_s: float) -> float | None:
        return self._trains("raw_bandwidth")


# ------------------------------------------------------------------------ typed calls


class RankCall(Generic[T]):
    """One typed request to one rank: ``run`` executes it on the rank's :class:`TrainerRank`
    where the rank lives; ``what`` names it in errors."""

    what: ClassVar[str] = "call"

    def run(self, rank: Any) -> T:
        raise NotImplementedError


@dataclass(frozen=True)
class Describe(RankCall[list[LocalParam]]):
    what = "describe"

    def run(self, rank: TrainerRank) -> list[LocalParam]:
        return list(rank.describe())


@dataclass(frozen=True)
class Join(RankCall[int]):
    info: JoinInfo
    what = "join"

    def run(self, rank: TrainerRank) -> int:
        return rank.join(self.info)


@dataclass(frozen=True)
class SetPlan(RankCall[str]):
    slice_wire: Mapping[str, Any]
    digest: str
    what = "set_plan"

    def run(self, rank: TrainerRank) -> str:
        return rank.set_plan(self.slice_wire, self.digest)


@dataclass(frozen=True)
class Refit(RankCall[RefitReply]):
    request: RefitRequest
    fault: TrainerFault | None = None  # set only by the testing path
    what = "refit"

    def run(self, rank: TrainerRank) -> RefitReply:
        return rank.refit(self.request, self.fault)


@dataclass(frozen=True)
class Leave(RankCall[None]):
    what = "leave"

    def run(self, rank: TrainerRank) -> None:
        rank.leave()


@dataclass(frozen=True)
class RunTask(RankCall[T]):
    task: RankTask[T]
    what = "run"

    def run(self, rank: TrainerRank) -> T:
        return rank.run(self.task)


@dataclass(frozen=True)
class TrainStep(RankCall[float]):
    token_ids: TokenIds
    lr: float | None = None  # None: the configured learning rate
    what = "train_step"

    def run(self, rank: TrainerRank) -> float:
        return rank.train_step(self.token_ids, self.lr)


@dataclass(frozen=True)
class Logprobs(RankCall[list[list[float]]]):
    token_ids: TokenIds
    version: int | None = None  # None: the current weights; else a snapshot's
    what = "logprobs"

    def run(self, rank: TrainerRank) -> list[list[float]]:
        return rank.logprobs(self.token_ids, self.version)


@dataclass(frozen=True)
class Snapshot(RankCall[int]):
    version: int
    keep: tuple[int, ...]
    what = "snapshot"

    def run(self, rank: TrainerRank) -> int:
        return rank.snapshot(self.version, self.keep)


@dataclass(frozen=True)
class GrpoStep(RankCall[float]):
    token_ids: TokenIds
    batch: GrpoBatch
    loss: PgLossSettings
    what = "grpo_step"

    def run(self, rank: TrainerRank) -> float:
        return rank.grpo_step(self.token_ids, self.batch, self.loss)


@dataclass(frozen=True)
class ReferenceLogprobs(RankCall[list[list[float]]]):
    token_ids: TokenIds
    what = "reference_logprobs"

    def run(self, rank: TrainerRank) -> list[list[float]]:
        return rank.reference_logprobs(self.token_ids)


@dataclass(frozen=True)
class LocalTensors(RankCall[dict[str, Any]]):
    what = "local_tensors"

    def run(self, rank: TrainerRank) -> dict[str, Any]:
        return rank.local_tensors()


@dataclass(frozen=True)
class RawBandwidth(RankCall["float | None"]):
    pairs: tuple[tuple[int, int], ...]
    nbytes: int
    timeout_s: float
    what = "raw_bandwidth"

    def run(self, rank: TrainerRank) -> float | None:
        return rank.raw_bandwidth(self.pairs, self.nbytes, self.timeout_s)


# ------------------------------------------------------------------------ the group


class Pending(Generic[T]):
    """One call on its way on every rank; :meth:`wait` collects it once."""

    def __init__(self, what: str, collect: Callable[[float, bool], list[Any]], timeout_s: float) -> None:
        self.what, self._collect, self._timeout_s = what, collect, timeout_s
        self.done = False

    def wait(self, timeout_s: float | None = None, *, every: bool = False) -> list[T]:
        """Every rank's reply in rank order; ``TrainerError`` naming the first rank that failed,
        died or missed the deadline (default: the group's). ``every``: after a failure, wait
        for every other rank too (its reply, its failure or its death, within the deadline)
        before raising: when this returns or raises, no rank is still at work -- e.g. a refit
        whose other ranks are still learning its decision."""
        if self.done:
            raise RuntimeError(f"{self.what!r} was already collected")
        self.done = True
        return self._collect(timeout_s or self._timeout_s, every)


class TrainerGroup:
    """Every training rank as a driver drives them: each typed call started on every rank at once,
    over one primitive a subclass provides (:meth:`_send`): ``pool.LocalTrainerGroup`` (local
    processes) and ``grpo.ray_cluster.RayTrainerGroup`` (Ray actors)."""

    world_size: int
    timeout_s: float = 300.0
    _in_flight: Pending[Any] | None = None

    def _send(self, what: str, calls: Sequence[RankCall[Any]]) -> Callable[[float, bool], list[Any]]:
        """Start ``calls[r]`` on rank ``r`` without waiting; return what collects every reply
        within a deadline (raising ``TrainerError`` naming a failed, dead or late rank; with
        its second argument true, only once every rank is done: ``Pending.wait(every=)``)."""
        raise NotImplementedError

    def start(self, calls: Sequence[RankCall[T]]) -> Pending[T]:
        """Rank-specific calls (``calls[r]`` on rank ``r``), e.g. each rank's plan slice."""
        if len(calls) != self.world_size:
            raise ValueError(f"{len(calls)} calls for {self.world_size} ranks")
        if self.in_flight is not None:
            raise RuntimeError(f"{self.in_flight!r} is still pending")
        what = calls[0].what
        pending: Pending[T] = Pending(what, self._send(what, calls), self.timeout_s)
        self._in_flight = pending
        return pending

    @property
    def in_flight(self) -> str | None:
        """The call started and not yet collected, if any (a group with one is not idle)."""
        p = self._in_flight
        return p.what if p is not None and not p.done else None

    def _each(self, call: RankCall[T]) -> Pending[T]:
        return self.start([call] * self.world_size)

    # -- the refit ----------------------------------------------------------------------------
    def describe(self) -> Pending[list[LocalParam]]:
        return self._each(Describe())

    def join(self, info: JoinInfo) -> Pending[int]:
        return self._each(Join(info))

    def set_plan(self, slices: Sequence[Mapping[str, Any]], digest: str) -> Pending[str]:
        return self.start([SetPlan(s, digest) for s in slices])

    def refit(self, request: RefitRequest, fault: TrainerFault | None = None) -> Pending[RefitReply]:
        return self._each(Refit(request, fault))

    def leave(self) -> Pending[None]:
        return self._each(Leave())

    def run(self, task: RankTask[T]) -> Pending[T]:
        return self._each(RunTask(task))

    # -- training -------------------------------------------------------------------------------
    def train_step(self, token_ids: TokenIds, lr: float | None = None) -> Pending[float]:
        return self._each(TrainStep(_tokens(token_ids), lr))

    def logprobs(self, token_ids: TokenIds, version: int | None = None) -> Pending[list[list[float]]]:
        """Every sequence's next-token logprobs under the current weights, or under the
        snapshot of policy ``version`` (:meth:`snapshot`)."""
        return self._each(Logprobs(_tokens(token_ids), version))

    def snapshot(self, version: int, keep: Sequence[int]) -> Pending[int]:
        """Keep a copy of the current weights as policy ``version`` and drop the snapshots not
        in ``keep``; each rank answers the bytes it now holds in snapshots."""
        return self._each(Snapshot(int(version), tuple(int(v) for v in keep)))

    def grpo_step(self, token_ids: TokenIds, batch: GrpoBatch, loss: PgLossSettings) -> Pending[float]:
        return self._each(GrpoStep(_tokens(token_ids), batch, loss))

    def reference_logprobs(self, token_ids: TokenIds) -> Pending[list[list[float]]]:
        return self._each(ReferenceLogprobs(_tokens(token_ids)))

    def local_tensors(self) -> Pending[dict[str, Any]]:
        return self._each(LocalTensors())

    def raw_bandwidth(self, pairs: Sequence[tuple[int, int]], nbytes: int,
                      timeout_s: float) -> Pending[float | None]:
        return self._each(RawBandwidth(tuple((int(a), int(b)) for a, b in pairs), nbytes, timeout_s))

    def dead(self) -> list[str]:
        return []

    def close(self) -> None:
        """Stop every rank (subclasses)."""


def _tokens(token_ids: TokenIds) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(t) for t in seq) for seq in token_ids)
