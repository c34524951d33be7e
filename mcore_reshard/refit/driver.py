"""The refit driver: orchestration only.

    descriptors (trainer ranks + engines) -> plan (pure, cached) -> ship slices -> refits
    -> every rank's RankReport gathered into RefitMetrics

It drives the training side through a ``ranks.TrainerGroup`` (``pool.LocalTrainerGroup``, a
``grpo.ray_cluster.RayTrainerGroup``, or a framework's own subclass) and its engines as
refit destinations (``transport.destination.Destination``: vLLM ``LLM`` / ``AsyncLLM`` objects
started with ``weight_transfer_config={"backend": "mcore_reshard"}`` are wrapped in
``adapters.vllm.destination.VllmEngine``; a Ray actor's engine is its own destination). The
engine side of every refit is ``transport.sequence.EngineRefit``, the same sequence the HTTP
controller and vLLM's trainer-side API run. An engine whose workers report is described by
what they record and confirmed by asking them; another is described by its adapter's rules
and checks its slice against what it holds at init.

A refit runs through a :class:`Transport`: :class:`ReshardTransport` (shard to shard, the
default) or the HF-broadcast baseline (``hf_broadcast.HFBroadcastTransport``). Opened as one
context manager::

    with RefitDriver(trainers, engines, refit_config, spec) as driver:
        metrics = driver.refit()
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import replace
from typing import Any, Callable, Protocol, Sequence

from .engines import ENGINE_GRACE_S, adapter_slots_of, as_destination, dst_layout_of, engine_dtype, engine_world
from ..transport.destination import DestinationInfo, EngineCallers, EngineCalls
from ..transport.sequence import EngineRefit, EngineRun
from ..errors import ConfigError, RefitFailed
from ..wire.faults import Faults
from ..layout import ModelSpec, SideLayout
from ..layout.lora import PeftConfig
from .metrics import RefitMetrics, bytes_at_minimum, reshard_metrics
from ..plan.refit_plans import RefitPlans, moves_encoder, plan_refit
from ..plan.types import TransferPlan
from ..plan.wire import slice_to_wire
from ..infra.ports import free_port
from ..wire.canary import canary_precision, make_canary
from ..wire.protocol import (Canary, EngineInitInfo, EngineUpdateInfo, JoinInfo, RankMap, RankReport, RefitRequest, WorkerStatus, first_error_line,
                       refit_id)
from ..training.ranks import TrainerGroup
from ..settings.policy import RefitConfig

__all__ = ["RefitDriver", "RefitMetrics", "bytes_at_minimum", "PendingRefit", "Transport", "ReshardTransport", "EngineCalls", "engine_world",
           "engine_dtype", "dst_layout_of", "ENGINE_GRACE_S"]

_log = logging.getLogger("mcore_reshard.refit.driver")

#: Seconds each side may take to leave the refit group when a driver closes.
CLOSE_DEADLINE_S = 30.0


class Transport(Protocol):
    """One way of moving a refit's weights from the trainers into the engines: the driver hands
    it the request and itself (trainers, engines, layouts, plan, and ``calls.on`` to call every
    engine at once with a deadline)."""

    #: ``RefitMetrics.transport``.
    name: str
    #: The vLLM worker extension its engine end needs (a qualified class name; None: any
    #: engine with the ``mcore_reshard`` weight-transfer backend).
    worker_extension: str | None

    def refit(self, driver: "RefitDriver", request: RefitRequest, faults: Faults | None) -> "RefitMetrics": ...

    def close(self, driver: "RefitDriver") -> None:
        """Release what it set up on either side (the driver closes every transport it ran)."""


class RefitDriver:
    """Plans once per layout, ships each rank its slice once, then refits by digest.

    ``trainers``: the training side (``ranks.TrainerGroup``); ``engines``: vLLM engines or handles;
    ``host`` / ``port``: the refit group's master, training rank 0's address, and a function
    giving a port free there; ``transport``: how :meth:`refit` moves the weights by default."""

    def __init__(self, trainers: TrainerGroup, engines: Sequence[Any], refit: RefitConfig, spec: ModelSpec, *,
                 src: SideLayout | None = None, dst: SideLayout | None = None, host: str = "127.0.0.1",
                 port: Callable[[], int] | None = None, placement: Any = None, links: Any = None,
                 transport: Transport | None = None, peft: PeftConfig | None = None,
                 frozen: frozenset[str] = frozenset()) -> None:
        self.trainers, self.engines, self.refit_config, self.spec = trainers, list(engines), refit, spec
        #: Tensors the policy never trains (a frozen vision tower, ``ModelSpec.frozen_tensors``):
        #: the first refit moves them, every later one plans without them (``plans.frozen_plan``).
        self.frozen = frozenset(frozen)
        self._holds = ""  # the refit every worker holds since this driver's last commit
        #: A LoRA policy: the first refit moves the base weights and the adapter (``plan``), every
        #: later one the adapter only (``adapter_plan``), into each engine's refit adapter slot.
        self.peft = peft if peft is not None and peft.enabled else None
        self.adapter_plan: TransferPlan | None = None
        #: The refit group's master: training rank 0's address, and a function giving a port free
        #: there (default: free here, for trainers on this machine).
        self.host = host
        self._port = port or (lambda: free_port(host))
        #: Where every rank sits (``plan.placed.RankPlacement``): the plan then prefers fan-out
        #: relays where they lower the modelled time at ``links``' bandwidths.
        self.placement, self.links = placement, links
        self.last_reports: list[RankReport] = []
        #: What the current refit has to say beyond its numbers (``RefitMetrics.notes``).
        self.notes: list[str] = []
        self.src, self.dst = src, dst
        #: Both sides and the plans (``plan.refit_plans``); ``plan`` is the next refit's.
        self.plans: RefitPlans | None = None
        self.plan: TransferPlan | None = None
        self.modes: dict[str, str] = {}
        self._shipped = ""
        #: What each engine is (world size, dtype, parallel sizes, whether it reports), read at describe.
        self.engine_infos: list[DestinationInfo] = []
        self.transport: Transport = transport or ReshardTransport()
        self._ran: list[Transport] = []  # every transport that ran: closed with the driver
        self.secret = secrets.token_hex(16)  # per job: every control message is authenticated with it
        self._epoch = 0  # refits so far: every request carries its number (signed messages are bound to it)
        self._nonce = ""  # the current refit group's (fresh at every join): part of every refit's identity
        #: The engines as refit destinations (``self.engines`` are what the caller passed).
        self.destinations = [as_destination(e) for e in self.engines]
        #: Every call on the engines (``driver.calls.on(fn, args)``), each with a deadline, and which
        #: engines are refused (``dead``).
        self.calls = EngineCallers(self.destinations)
        #: Seconds an engine may take to answer ``update_weights`` once every trainer is done.
        self.engine_grace_s = ENGINE_GRACE_S
        #: Engines kept paused after a refit they could not confirm (index -> why).
        self.gated: dict[int, str] = {}
        #: The current refit group's join info (its store's address; None before the first join).
        self.join_info: JoinInfo | None = None

    # -- set-up ----------------------------------------------------------------------------
    def __enter__(self) -> "RefitDriver":
        self.make_plan()
        self.connect()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def engine_offsets(self) -> list[int]:
        """Engine ``e``'s first destination rank."""
        sizes = [i.world_size for i in self.engine_infos]
        return [sum(sizes[:e]) for e in range(len(sizes))]

    def free_port(self) -> int:
        """A port free where the refit group's master listens (training rank 0)."""
        return self._port()

    def make_plan(self) -> TransferPlan:
        """Both sides' descriptors -> the plans (``plan.refit_plans.plan_refit``, the one
        function vLLM's trainer-side API plans with too; cached on the layouts' digests)."""
        if self.src is None:
            params = tuple(p for rank in self.trainers.describe().wait() for p in rank)
            self.src = SideLayout("megatron-live", self.trainers.world_size, params, self.spec.tensor_table())
        self.engine_infos = [d.info() for d in self.destinations]
        sizes = [i.world_size for i in self.engine_infos]
        engine_spec = self.spec.with_dtype(self.engine_infos[0].dtype)
        # Each engine says what its workers hold (an engine that drafts learns its draft first).
        described = [d.describe(engine_spec) for d in self.destinations]
        given = self.dst is not None
        # The engine's own dtype: a trainer in another one (fp32 main weights, a bf16 model
        # into an fp32 engine) is planned as a cast, allowed only with refit.allow_cast.
        dst = self.dst or dst_layout_of(described, engine_spec, name=f"vllm({len(self.engines)} engine(s) of {sizes[0]})")
        not_direct = described[0].not_direct
        if not_direct is None:
            not_direct = (("*", "unknown: the engine's workers cannot be asked which parameters they write in place"),)
        cfg = self.refit_config
        self.plans = plan_refit(
            self.src, dst, self.spec, engine_spec, peft=self.peft, extend_dst=not given,
            slots=adapter_slots_of(self.engine_infos, engine_spec, self.peft) if self.peft and not given else None,
            bucket_bytes=cfg.bucket_bytes, allow_cast=cfg.allow_cast, not_direct=not_direct,
            placement=self.placement, links=self.links, frozen=self.frozen)
        self.src, self.dst = self.plans.src, self.plans.dst
        self.plan, self.adapter_plan = self.plans.plan, self.plans.adapter_plan
        return self.plan

    def plan_sides(self) -> tuple[SideLayout, SideLayout]:
        """The two sides of the current plan: a LoRA policy's adapter plan has the adapter only."""
        return self.plans.sides(self.plan)

    def committed(self, request: RefitRequest) -> None:
        """A refit committed on every rank: a LoRA policy's base weights (a frozen tower) are in
        the engines after its first, so every later refit moves the adapter only (all but the
        tower). Every worker now holds this refit: a refit that leaves frozen weights out first
        checks that they still do (:meth:`check_frozen`)."""
        if request.plan_digest == self.plan.digest():
            self.plan = self.plans.after_commit(self.plan)
            self._holds = self.refit_id(request)

    def check_frozen(self) -> None:
        """Before a refit that leaves the frozen tensors out (a frozen vision tower): every
        worker of every engine must still hold the weights of the last refit this driver
        committed -- the one that wrote (or kept) the tower the trainers hold. An engine
        reloaded, restarted or refit by someone else since may hold another tower: refused in
        one line before anything moves (the engines keep their weights); :meth:`resend_frozen`
        makes the next refit a full one. An engine whose workers cannot be asked is named in
        the refit's notes (not checked)."""
        if self.plans is None or self.plans.frozen_plan is None or self.plan is not self.plans.frozen_plan:
            return
        for e, (dest, info) in enumerate(zip(self.destinations, self.engine_infos)):
            if not info.reports:
                self.notes.append(f"engine {e}: frozen tensors not checked (its workers cannot be asked): it is "
                                  f"trusted to hold the tower refit {self._holds} wrote")
                continue
            got: list[WorkerStatus] = []
            errors = self.calls.on(lambda d, _: got.extend(d.status() or []), only=e, what="status (frozen tower)",
                                   deadline_s=30.0)
            held = {st.refit for st in got}
            if errors or held != {self._holds}:
                why = "; ".join(errors) if errors else (f"its workers hold refit {sorted(held)}"
                                                        + (" (as loaded)" if held == {""} else ""))
                raise RefitFailed(
                    f"frozen vision tower: engine {e} may not hold the tower the trainers hold ({why}, not refit "
                    f"{self._holds}, which wrote it); nothing moved, the engines keep their weights -- "
                    f"driver.resend_frozen() makes the next refit send the frozen tensors again")

    def resend_frozen(self) -> None:
        """The next refit moves every tensor again, the frozen ones too (then leaves them out)."""
        if self.plans is not None:
            self.plan = self.plans.plan

    def connect(self) -> None:
        """Build the refit group and give every rank its slice (again after a failed refit, or
        when the plan changed): trainers join while each engine initialises its engine."""
        plan = self.plan
        digest = plan.digest()
        rank_map = RankMap.disaggregated(self.src.world_size, self.dst.world_size)
        info = JoinInfo(self.host, self._port(), rank_map.world_size, rank_map, self.refit_config.timeout_s,
                        secret=self.secret, nonce=secrets.token_hex(16))
        self._nonce, self.join_info = info.nonce, info
        joining = self.trainers.join(info)
        inits = []
        for lo, eng in zip(self.engine_offsets, self.engine_infos):
            slices = {r: slice_to_wire(plan.for_rank("dst", r)) for r in range(lo, lo + eng.world_size)}
            inits.append(EngineInitInfo(replace(info, dst_offset=lo), digest, slices, lora=self.peft))
        errors = self.calls.on(lambda d, init: d.join(init), inits, what="init_weight_transfer_engine",
                                 deadline_s=self.refit_config.timeout_s + 60.0)
        try:
            joining.wait()
        except Exception as exc:  # noqa: BLE001 - reported with the engines' errors
            errors.append(f"training side: {first_error_line(exc)}")
        if errors:
            raise RefitFailed("joining the refit group failed: " + "; ".join(errors))
        self.trainers.set_plan([slice_to_wire(plan.for_rank("src", r)) for r in range(self.src.world_size)],
                               digest).wait()
        self._shipped = digest

    def ensure_connected(self) -> bool:
        """Connect unless the plan's slices are shipped on a healthy group; True when they
        were (the refit runs on the cached plan)."""
        if self._shipped == self.plan.digest():
            return True
        self.connect()
        return False

    def disconnect(self) -> None:
        """The refit group is broken on every rank (a failed refit): rejoin at the next one."""
        self._shipped = ""

    # -- calls on the engines (``engines.EngineCallers``: deadlines, dead and unresponsive ones) --
    @property
    def dead(self) -> dict[int, str]:
        """Engines this driver refuses (index -> why): dead until replaced, or unresponsive
        until the call they left running returns (then readmitted)."""
        return self.calls.dead

    def readmit(self) -> list[int]:
        """Unresponsive engines that answer again, taken back gated: each stays paused until a
        refit commits on all of its workers (the refit it missed may have left a mix)."""
        back = self.calls.readmit(lambda d, e: d.status())
        for e in back:
            self.gated[e] = "readmitted after it was unresponsive; the refit it missed may have left a mix"
        return back

    def refuse_dead(self) -> None:
        """Raise ``RefitFailed`` naming every engine this driver refuses (after readmitting any
        that answer again)."""
        self.readmit()
        if self.dead:
            raise RefitFailed("; ".join(self.calls.line(e) for e in sorted(self.dead)))

    # -- refits -------------------------------------------------------------------------------
    def request(self) -> RefitRequest:
        """The next refit's request from the refit config; with ``refit.canary`` it carries the
        canary, whose reference the trainers compute inside the refit from the weights they send."""
        cfg = self.refit_config
        return RefitRequest(self.plan.digest(), cfg.verify, cfg.timeout_s, cfg.atomic, overlap=cfg.overlap,
                            delta=cfg.delta, delta_state_limit_bytes=cfg.delta_state_limit_bytes,
                            canary=self.canary() if cfg.canary else None,
                            encoders=moves_encoder(self.plan, self.spec))

    def canary(self, now: bool = False) -> Canary:
        """The canary of the next refit (``refit.canary``): the fixed sequences and the bound of
        the engines' precision, deferred -- the trainers fill in their most likely tokens after
        each prefix and their log-probs inside the refit, after their last byte
        (``Canary.deferred``), and where the engines draft (MTP) the draft's too. ``now``: the
        target's computed here, before the refit (what the canary cost before it was deferred;
        ``scripts/bench_canary.py`` compares the two)."""
        cfg = self.refit_config
        dtype = canary_precision(self.engine_infos[0].dtype if self.engine_infos else self.spec.dtype, self.plan)
        top = (lambda seqs: self.trainers.top_logprobs(seqs).wait()[0]) if now else None
        drafts = not now and self.dst is not None and any(p.name.startswith("draft.") for p in self.dst.params)
        return make_canary(self.spec.vocab, dtype, cfg.canary_sequences, cfg.canary_tokens, cfg.canary_bound, top,
                           draft=drafts)

    def next_epoch(self) -> int:
        """The number of the next refit on this driver's groups (signed messages are bound to it)."""
        self._epoch += 1
        return self._epoch

    def refit_id(self, request: RefitRequest) -> str:
        """The identity of refit ``request`` (its epoch set) on the current group: what every
        worker that commits it holds (``WorkerStatus.refit``). Unique per job: the group's
        nonce is fresh at every join, so no other driver's refit, nor this driver's on another
        group, has it."""
        return refit_id(request.plan_digest, self._nonce, request.epoch)

    def refit(self, request: RefitRequest | None = None, *, transport: Transport | None = None,
              faults: Faults | None = None) -> RefitMetrics:
        """One refit through ``transport`` (default: this driver's, shard to shard), with
        ``request`` (default: :meth:`request`, from the refit config). Raises ``RefitFailed``
        naming every failing rank of either side, and every engine that is gated or dead.

        ``faults``: fault injection (tests and soak runs only): a fault on one training rank or
        one vLLM worker (``faults.Faults``)."""
        self.refuse_dead()
        self.check_frozen()
        transport = transport or self.transport
        if not any(t is transport for t in self._ran):
            self._ran.append(transport)
        metrics = transport.refit(self, request or self.request(), faults)
        _log.info("refit %s: %d bytes moved (minimum %d) in %.3fs, peak extra %d bytes, verified=%s, phases %s",
                  metrics.transport, metrics.bytes_moved, metrics.bytes_min, metrics.seconds,
                  metrics.peak_extra_bytes, metrics.verified, metrics.phases)
        return metrics

    def begin_refit(self, request: RefitRequest | None = None, *, faults: Faults | None = None) -> "PendingRefit":
        """Start an overlapped refit and return at once: the trainers send, every vLLM worker
        receives into shadow weights on its own thread, and the engines keep serving the old
        weights meanwhile (a caller on this thread may ``generate``). ``PendingRefit.finish``
        waits for the decision, then pauses each engine only to swap. ``request`` (default:
        :meth:`request`) is sent with ``overlap=True``."""
        self.refuse_dead()
        self.check_frozen()
        if not isinstance(self.transport, ReshardTransport):
            raise ConfigError(f"refit.overlap needs the reshard transport, not {self.transport.name}")
        cap = self.refit_config.max_shadow_bytes
        per_rank = self.plan.recv_bytes() if cap else []
        if per_rank and max(per_rank) > cap:
            r = per_rank.index(max(per_rank))
            raise ConfigError(f"refit.max_shadow_bytes={cap}: an overlapped refit holds a shadow of what each vLLM "
                              f"worker receives, and destination rank {r} receives {max(per_rank)} bytes")
        if not any(t is self.transport for t in self._ran):
            self._ran.append(self.transport)
        return self.transport.begin(self, replace(request or self.request(), overlap=True), faults)

    def status(self) -> list[WorkerStatus]:
        """Every worker's serving state, version and last outcome (engines whose workers report)."""
        self.readmit()
        got: list[list[WorkerStatus]] = [[] for _ in self.engines]
        errors = [f"engine {e}: its workers cannot be asked (no diagnostics extension, worker_extension_cls)"
                  for e, info in enumerate(self.engine_infos) if not info.reports]
        errors += self.calls.on(lambda d, e: got[e].extend(d.status() or []), list(range(len(self.engines))),
                                  what="status", deadline_s=30.0)
        if errors:
            raise RefitFailed("; ".join(errors))
        return [st for per in got for st in per]

    def close(self) -> None:
        """Leave both sides, every call with a deadline (an engine that does not answer is
        left behind, named in the log: closing never hangs on a stopped worker)."""
        for transport in reversed(self._ran):
            try:
                transport.close(self)
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        try:
            self.trainers.leave().wait(CLOSE_DEADLINE_S)
        except Exception as exc:  # noqa: BLE001 - best effort on the way out
            _log.warning("closing the refit driver: the trainers did not leave: %s", first_error_line(exc))
        errors = self.calls.on(lambda d, _: d.close(), what="shutdown_weight_transfer_engine",
                                 deadline_s=CLOSE_DEADLINE_S)
        if errors:
            _log.warning("closing the refit driver: %s", "; ".join(errors))


class ReshardTransport:
    """Shard to shard (the default transport): every trainer endpoint and every engine at
    once; they vote, one decision is written, all commit or none does. After a failure the
    refit group is rebuilt at the next refit.

    No engine ever serves a mix of old and new weights: the engines' side is
    ``transport.sequence.EngineRefit`` -- each engine paused for a blocking refit (vLLM's own
    scheduler pause), confirmed afterwards by what its workers hold, resumed only when whole,
    else kept **gated** (paused: no model step for any client -- ``generate``, ``enqueue``,
    ``AsyncLLM``, a server) until a refit succeeds. An engine that does not answer within its
    deadline is refused until it answers again or is replaced."""

    name = "reshard"
    worker_extension: str | None = None

    def refit(self, driver: RefitDriver, request: RefitRequest, faults: Faults | None) -> RefitMetrics:
        if request.overlap:
            return self.begin(driver, request, faults).finish()
        cached = driver.ensure_connected()
        request = replace(request, epoch=driver.next_epoch())
        faults = faults or Faults()
        t0 = time.perf_counter()
        engines = self._engine_refit(driver, request, faults)
        try:
            engines.start()  # paused, sessions open, every engine receiving
        except RefitFailed:
            driver.disconnect()
            raise
        refitting = driver.trainers.refit(request, faults.trainer)
        replies, trainer_error = _wait_trainers(driver, refitting, request)
        # Every trainer has read the decision (or died): a worker that read it too answers
        # within moments. One that does not within the grace is dead or stuck, and so is its
        # engine (vLLM's core waits on that worker's reply without a deadline).
        errors = engines.finish(trusted=trainer_error is None)
        seconds = time.perf_counter() - t0
        driver.notes += engines.notes
        return self.result(driver, request, replies, trainer_error, errors, seconds, time.perf_counter() - t0, cached)

    @staticmethod
    def _engine_refit(driver: RefitDriver, request: RefitRequest, faults: Faults) -> EngineRefit:
        run = EngineRun(EngineUpdateInfo(request, faults.engine), request.label(driver.refit_id(request)),
                        driver.refit_id(request), overlap=request.overlap, grace_s=driver.engine_grace_s,
                        recompute=driver.refit_config.recompute_kv_cache_after_weight_updates,
                        encoders=request.encoders)
        return EngineRefit(driver.calls, run, driver.gated)

    def begin(self, driver: RefitDriver, request: RefitRequest, faults: Faults | None) -> "PendingRefit":
        """An overlapped refit's first half: every engine's session opens and its
        ``update_weights`` returns at once (its workers receive on their own threads) while
        the trainers start sending."""
        cached = driver.ensure_connected()
        request = replace(request, epoch=driver.next_epoch())
        faults = faults or Faults()
        t0 = time.perf_counter()
        engines = self._engine_refit(driver, request, faults)
        refitting = driver.trainers.refit(request, faults.trainer)
        try:
            errors = engines.start()
        except RefitFailed as exc:
            _wait_trainers(driver, refitting, request)  # no engine joined: they time out and leave
            driver.disconnect()
            raise exc from None
        return PendingRefit(self, driver, request, refitting, engines, errors, t0, cached)

    def result(self, driver: RefitDriver, request: RefitRequest, replies: Any, trainer_error: str | None,
               errors: list[str], seconds: float, pause_s: float, cached: bool) -> RefitMetrics:
        """The refit's metrics from every rank's report, or ``RefitFailed`` naming every error
        (the group is then rejoined at the next refit). A blocking refit and an overlapped one's
        ``PendingRefit.finish`` end here alike."""
        if trainer_error is not None or errors:
            driver.notes = []
            driver.disconnect()  # the group is broken on every rank: rejoin next time
            raise RefitFailed("; ".join(([trainer_error] if trainer_error else []) + errors))
        reports = [r for r in replies[0].reports if r is not None]
        driver.last_reports = reports
        m = reshard_metrics(reports, seconds, cached, request, driver.plan, driver.dst.world_size)
        driver.committed(request)
        notes, driver.notes = tuple(driver.notes), []
        return replace(m, pause_seconds=pause_s, overlapped=request.overlap, notes=m.notes + notes)

    def close(self, driver: RefitDriver) -> None:
        """Nothing beyond the refit group, which the driver leaves itself."""


def _wait_trainers(driver: RefitDriver, refitting: Any, request: RefitRequest) -> tuple[Any, str | None]:
    """Every trainer's reply (all of them, not the first that fails: when this returns no
    trainer is still waiting for the decision), or the line naming every failing rank."""
    try:
        return refitting.wait(trainers_deadline(request), every=True), None
    except Exception as exc:  # noqa: BLE001 - the trainers' error names every failing rank
        return None, "; ".join(driver.trainers.dead() + [first_error_line(exc)])


class PendingRefit:
    """An overlapped refit between :meth:`RefitDriver.begin_refit` and :meth:`finish`: the
    engines serve their old weights while the new ones arrive in their shadows."""

    def __init__(self, transport: ReshardTransport, driver: RefitDriver, request: RefitRequest, refitting: Any,
                 engines: EngineRefit, errors: list[str], t0: float, cached: bool) -> None:
        self.transport, self.driver, self.request = transport, driver, request
        self._refitting, self._engines, self._errors, self._t0, self._cached = refitting, engines, errors, t0, cached
        self._finished = False

    def finish(self) -> RefitMetrics:
        """Wait for the trainers (every rank has voted and read the decision by then), then
        per engine: pause its scheduler (``keep``: running requests stay, frozen), swap the
        shadows in or drop them (``finish_weight_update``, every worker between the same two
        model steps), set the version, resume. ``pause_seconds``: that pause. Raises
        ``RefitFailed`` as a blocking refit does; the engines then kept their old weights."""
        if self._finished:
            raise RuntimeError("this refit was already finished")
        self._finished = True
        driver, request = self.driver, self.request
        replies, trainer_error = _wait_trainers(driver, self._refitting, request)
        seconds = time.perf_counter() - self._t0
        t_pause = time.perf_counter()
        errors = self._errors + self._engines.finish(trusted=trainer_error is None and not self._errors)
        driver.notes += self._engines.notes
        return self.transport.result(driver, request, replies, trainer_error, errors, seconds,
                                     time.perf_counter() - t_pause, self._cached)


def trainers_deadline(request: RefitRequest) -> float:
    """How long the driver waits for the trainers' refit replies: the refit's own timeout (a
    silent peer's), the decision's grace past it, and a margin for the replies to arrive. The
    trainers' own waits all end by then, so the driver's error is theirs, never its own
    timeout racing them."""
    return request.timeout_s + 30.0
