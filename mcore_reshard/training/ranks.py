"""The training side of a refit, as one typed protocol.

A driver talks to a group of training ranks through typed methods with typed replies
(nothing unpickled by hand)::

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
it that answers the calls where the rank lives (``pool.PolicyRank`` adds this
project's policy and its training calls), and the :class:`TrainerGroup` a driver calls. Each
call is written once, as the rank's method: a :class:`RankCall` names it, and the group binds
it to every rank in one line (:func:`every_rank`), over one primitive, "send rank r its call
and return how to collect the replies": ``pool.LocalTrainerGroup`` (local processes) and
``grpo.ray_cluster.RayTrainerGroup`` (Ray actors) implement only that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generic, Mapping, Protocol, Sequence, TypeVar

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
    the training calls are this project's policy's (``pool.PolicyRank``), a framework's
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


# ------------------------------------------------------------------------ typed calls


#: The training calls: this project's policies answer them (``pool.PolicyRank``); a
#: framework's rank, which answers the refit calls only, refuses each in one line.
TRAINING_CALLS = ("train_step", "logprobs", "top_logprobs", "snapshot", "grpo_step", "reference_logprobs",
                  "local_tensors", "raw_bandwidth")


@dataclass(frozen=True)
class RankCall(Generic[T]):
    """One request to one rank: the :class:`TrainerRank` method ``what`` with ``args``, run
    where the rank lives (``run(rank)``: a local process, a Ray actor). Each call is written
    once, as the rank's method; this record only names it, and :class:`TrainerGroup` binds it
    to every rank (:func:`every_rank`)."""

    what: str
    args: tuple[Any, ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()

    def run(self, rank: Any) -> T:
        method = getattr(rank, self.what, None) if not self.what.startswith("_") else None
        if method is None or not callable(method):
            if self.what in TRAINING_CALLS:
                raise TypeError(f"training rank {rank.rank} answers refit calls only ({type(rank).__name__} around "
                                f"a framework's TrainerEndpoint): {self.what!r} is a call of this project's policy")
            raise TypeError(f"{type(rank).__name__} has no call {self.what!r}")
        return method(*self.args, **dict(self.kwargs))


def every_rank(what: str, normalize: Callable[..., tuple[Any, ...]] | None = None) -> Callable[..., "Pending[Any]"]:
    """The group form of the rank method ``what``: the same call started on every rank at once
    (``normalize`` makes its leading positional arguments plain values first: token ids as
    tuples of ints; named arguments go through by name)."""

    def call(self: "TrainerGroup", *args: Any, **kwargs: Any) -> "Pending[Any]":
        if normalize is not None:
            args = normalize(*args)
        return self._each(RankCall(what, tuple(args), tuple(sorted(kwargs.items()))))

    call.__name__ = call.__qualname__ = what
    call.__doc__ = f"``{what}`` on every rank at once (``TrainerRank.{what}`` / ``PolicyRank.{what}``)."
    return call


def _tokens(token_ids: TokenIds) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(t) for t in seq) for seq in token_ids)


def _with_tokens(token_ids: TokenIds, *rest: Any) -> tuple[Any, ...]:
    return (_tokens(token_ids), *rest)


def _snapshot_args(version: int, keep: Sequence[int]) -> tuple[Any, ...]:
    return (int(version), tuple(int(v) for v in keep))


def _bandwidth_args(pairs: Sequence[tuple[int, int]], nbytes: int, timeout_s: float) -> tuple[Any, ...]:
    return (tuple((int(a), int(b)) for a, b in pairs), int(nbytes), float(timeout_s))


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

    # -- the refit (``TrainerRank``'s calls) ------------------------------------------------------
    describe: Callable[[], Pending[list[LocalParam]]] = every_rank("describe")
    join: Callable[[JoinInfo], Pending[int]] = every_rank("join")
    leave: Callable[[], Pending[None]] = every_rank("leave")
    #: ``refit(request, fault=None)``: every rank's ``RefitReply`` (``fault``: the testing path)
    refit: Callable[..., Pending[RefitReply]] = every_rank("refit")
    #: ``run(task)``: a transport's own trainer end on every rank
    run: Callable[[RankTask[Any]], Pending[Any]] = every_rank("run")

    def set_plan(self, slices: Sequence[Mapping[str, Any]], digest: str) -> Pending[str]:
        """Rank ``r``'s own slice of the plan to rank ``r``."""
        return self.start([RankCall("set_plan", (s, digest)) for s in slices])

    # -- training (``pool.PolicyRank``'s calls) --------------------------------------------------
    #: ``train_step(token_ids, lr=None)``: the loss
    train_step: Callable[..., Pending[float]] = every_rank("train_step", _with_tokens)
    #: ``logprobs(token_ids, version=None)``: under the current weights, or snapshot ``version``'s
    logprobs: Callable[..., Pending[list[list[float]]]] = every_rank("logprobs", _with_tokens)
    #: ``top_logprobs(token_ids)``: per sequence, the policy's most likely next token after each
    #: prefix and its log-prob, under the current weights (the canary's reference)
    top_logprobs: Callable[[TokenIds], Pending[list[tuple[list[int], list[float]]]]] = every_rank(
        "top_logprobs", _with_tokens)
    #: ``snapshot(version, keep)``: keep the weights as ``version``, drop those not in ``keep``
    snapshot: Callable[[int, Sequence[int]], Pending[int]] = every_rank("snapshot", _snapshot_args)
    grpo_step: Callable[[TokenIds, GrpoBatch, PgLossSettings], Pending[float]] = every_rank("grpo_step", _with_tokens)
    reference_logprobs: Callable[[TokenIds], Pending[list[list[float]]]] = every_rank("reference_logprobs",
                                                                                      _with_tokens)
    local_tensors: Callable[[], Pending[dict[str, Any]]] = every_rank("local_tensors")
    raw_bandwidth: Callable[[Sequence[tuple[int, int]], int, float], Pending["float | None"]] = every_rank(
        "raw_bandwidth", _bandwidth_args)

    def dead(self) -> list[str]:
        return []

    def close(self) -> None:
        """Stop every rank (subclasses)."""

