"""The refit driver: orchestration only.

    descriptors (trainer ranks + engines) -> plan (pure, cached) -> ship slices -> refits
    -> every rank's RankReport gathered into RefitMetrics

It drives the training side through a ``ranks.TrainerGroup`` (``pool.LocalTrainerGroup``, a
``grpo.ray_cluster.RayTrainerGroup``, or a framework's own subclass) and
vLLM engines (``LLM`` objects started with ``weight_transfer_config={"backend": "mcore_reshard"}``,
or handles with the same methods and an ``engine_info``), talking to the engines only through
vLLM's own weight-transfer calls. An engine with the diagnostics extension is described by
what its workers record and confirmed by asking them; a plain one is described by the rules
(``adapters.vllm.rules.vllm_layout``) and checks its slice against what it holds at init.

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
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from .engines import (ENGINE_GRACE_S, EngineCallers, EngineCalls, adapter_slots_of, dst_layout_of, engine_dtype,
                      engine_is_dead, engine_world, finish_quietly, finish_update)
from ..errors import ConfigError, RefitFailed
from ..wire.faults import Faults
from ..layout import ModelSpec, SideLayout
from ..layout.lora import PeftConfig, adapter_tensors, adapters_only
from ..layout.mtp import draft_tensors
from .metrics import RefitMetrics, bytes_at_minimum, reshard_metrics
from ..plan import get_plan
from ..plan.topology import Links, plan_for_placement
from ..plan.types import TransferPlan
from ..plan.wire import slice_to_wire
from ..infra.ports import free_port
from ..wire.protocol import (EngineInitInfo, EngineUpdateInfo, JoinInfo, RankMap, RankReport, RefitRequest, WorkerStatus, first_error_line,
                       refit_id)
from ..training.ranks import TrainerGroup
from ..settings.policy import RefitConfig

if TYPE_CHECKING:
    from ..adapters.vllm.engine import EngineInfo

__all__ = ["RefitDriver", "RefitMetrics", "bytes_at_minimum", "PendingRefit", "Transport", "ReshardTransport", "EngineCalls", "engine_world",
           "engine_dtype", "dst_layout_of", "ENGINE_GRACE_S"]

_log = logging.getLogger("mcore_reshard.refit.driver")

#: Seconds each side may take to leave the refit group when a driver closes.
CLOSE_DEADLINE_S = 30.0


class Transport(Protocol):
    """One way of moving a refit's weights from the trainers into the engines: the driver hands
    it the request and itself (trainers, engines, layouts, plan, and ``on_engines`` to call every
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
                 transport: Transport | None = None, peft: PeftConfig | None = None) -> None:
        self.trainers, self.engines, self.refit_config, self.spec = trainers, list(engines), refit, spec
        #: A LoRA policy: the first refit moves the base weights and the adapter (``plan``), every
        #: later one the adapter only (``adapter_plan``), into each engine's refit adapter slot.
        self.peft = peft if peft is not None and peft.enabled else None
        self.adapter_plan: TransferPlan | None = None
        #: The refit group's master: training rank 0's address, and a function giving a port free
        #: there (default: free here, for trainers on this machine).
        self.host = host
        self._port = port or (lambda: free_port(host))
        #: Where every rank sits (``plan.topology.RankPlacement``): the plan then prefers fan-out
        #: relays where they lower the modelled time at ``links``' bandwidths.
        self.placement, self.links = placement, links
        self.last_reports: list[RankReport] = []
        #: What the current refit has to say beyond its numbers (``RefitMetrics.notes``).
        self.notes: list[str] = []
        self.src, self.dst = src, dst
        self.plan: TransferPlan | None = None
        self.modes: dict[str, str] = {}
        self._shipped = ""
        #: What each engine is (world size, dtype, parallel sizes, extension), read at describe.
        self.engine_infos: list[EngineInfo] = []
        self.transport: Transport = transport or ReshardTransport()
        self._ran: list[Transport] = []  # every transport that ran: closed with the driver
        self.secret = secrets.token_hex(16)  # per job: every control message is authenticated with it
        self._epoch = 0  # refits so far: every request carries its number (signed messages are bound to it)
        self._nonce = ""  # the current refit group's (fresh at every join): part of every refit's identity
        #: Every call on the engines, with a deadline, and which engines are refused (``dead``).
        self.calls = EngineCallers(self.engines)
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
        """Both sides' descriptors -> the plan (cached on the layouts' digests)."""
        from ..adapters.vllm.engine import engine_info

        tensors = self.spec.tensor_table()
        if self.peft is not None:
            tensors = {**tensors, **adapter_tensors(self.spec, self.peft)}
        if self.src is None:
            params = tuple(p for rank in self.trainers.describe().wait() for p in rank)
            self.src = SideLayout("megatron-live", self.trainers.world_size, params, tensors)
        if self.peft is not None:
            check_adapter_shapes(self.src, adapter_tensors(self.spec, self.peft), self.peft)
        self.src = with_draft_tensors(self.src, self.spec)
        self.engine_infos = [engine_info(llm) for llm in self.engines]
        sizes = [i.world_size for i in self.engine_infos]
        self.name_drafts()
        if self.dst is None:
            # The engine's own dtype: a trainer in another one (fp32 main weights, a bf16 model
            # into an fp32 engine) is planned as a cast, allowed only with refit.allow_cast.
            self.dst = dst_layout_of(self.engines, self.spec.with_dtype(self.engine_infos[0].dtype),
                                     name=f"vllm({len(self.engines)} engine(s) of {sizes[0]})")
            if self.peft is not None:
                self.dst = adapter_slots_of(self.dst, self.engine_infos, self.spec.with_dtype(self.engine_infos[0].dtype),
                                            self.peft)
            self.dst = with_draft_tensors(self.dst, self.spec.with_dtype(self.engine_infos[0].dtype))
        not_direct: tuple = (("*", "unknown: the engine has no mcore_reshard diagnostics extension to ask"),)
        if self.engine_infos[0].diagnostics:
            try:
                from ..adapters.vllm.engine import STATUS_DEADLINE_S, engine_call

                self.modes = {}
                llm = self.engines[0]
                for rank_modes in engine_call(llm, "mr_modes", lambda: llm.collective_rpc("mr_modes"),
                                              STATUS_DEADLINE_S):
                    self.modes.update(rank_modes)
                not_direct = tuple(sorted(
                    (name, "kernel format differs from model format: written through vLLM's layerwise reload")
                    for name, mode in self.modes.items() if mode != "direct"))
            except Exception as exc:  # noqa: BLE001 - the plan is still right; only this note is unknown
                not_direct = (("*", f"unknown: asking the engine failed: {first_error_line(exc)}"),)
        cfg = self.refit_config
        if self.placement is not None:
            self.plan = plan_for_placement(self.src, self.dst, self.placement, self.links or Links(),
                                           bucket_bytes=cfg.bucket_bytes, allow_cast=cfg.allow_cast,
                                           not_direct=not_direct)
        else:
            self.plan = get_plan(self.src, self.dst, bucket_bytes=cfg.bucket_bytes, allow_cast=cfg.allow_cast,
                                 not_direct=not_direct)
        if self.peft is not None:
            self.adapter_plan = get_plan(adapters_only(self.src), adapters_only(self.dst),
                                         bucket_bytes=cfg.bucket_bytes, allow_cast=cfg.allow_cast)
        return self.plan

    def plan_sides(self) -> tuple[SideLayout, SideLayout]:
        """The two sides of the current plan: a LoRA policy's adapter plan has the adapter only."""
        if self.adapter_plan is not None and self.plan is self.adapter_plan:
            return adapters_only(self.src), adapters_only(self.dst)
        return self.src, self.dst

    def name_drafts(self) -> None:
        """Every engine that runs a speculative-decoding draft learns where it is through vLLM's
        own draft session (``start_draft_weight_update`` then ``finish_weight_update``, nothing
        sent): from then on it describes the draft beside the target, and every refit moves both
        in one vote. An engine whose draft the training side does not hold is refused at plan
        time (the planner names the draft tensor no rank holds)."""
        def name(llm: Any, _: Any) -> None:
            llm.start_draft_weight_update()
            llm.finish_weight_update()

        # Only the engines that draft: one without a draft is not called at all (an unresponsive
        # one is refused by the refit itself, not here).
        drafts = [e for e, info in enumerate(self.engine_infos) if info.draft]
        errors = [err for e in drafts for err in self.on_engines(name, what="start_draft_weight_update", only=e,
                                                                   deadline_s=60.0)]
        if errors:
            raise RefitFailed("naming the engines' draft models failed: " + "; ".join(errors))

    def committed(self, request: RefitRequest) -> None:
        """A refit committed on every rank: a LoRA policy's base weights are in the engines
        after its first, so every later refit moves the adapter only."""
        if self.adapter_plan is not None and request.plan_digest == self.plan.digest() != self.adapter_plan.digest():
            self.plan = self.adapter_plan

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
        errors = self.on_engines(lambda llm, init: llm.init_weight_transfer_engine({"init_info": init.to_wire()}),
                                 inits, what="init_weight_transfer_engine",
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

    def on_engines(self, fn: Callable[[Any, Any], Any], args: Sequence[Any] | None = None, *, what: str = "call",
                   deadline_s: float = 300.0, only: int | None = None) -> list[str]:
        """Run ``fn(llm, arg)`` on every engine (or engine ``only``) at once, each with a
        deadline; one error line per failure (``EngineCallers.on``)."""
        return self.calls.on(fn, args, what=what, deadline_s=deadline_s, only=only)

    def start_on_engines(self, fn: Callable[[Any, Any], Any], args: Sequence[Any] | None = None, *,
                         what: str = "call", only: int | None = None) -> EngineCalls:
        return self.calls.start(fn, args, what=what, only=only)

    def wait_on_engines(self, calls: EngineCalls, deadline_s: float) -> list[str]:
        return self.calls.wait(calls, deadline_s)

    def dead_line(self, e: int) -> str:
        return self.calls.line(e)

    def readmit(self) -> list[int]:
        """Unresponsive engines that answer again, taken back gated: each stays paused until a
        refit commits on all of its workers (the refit it missed may have left a mix)."""
        back = self.calls.readmit(lambda llm, e: self._probe(llm, e))
        for e in back:
            self.gated[e] = "readmitted after it was unresponsive; the refit it missed may have left a mix"
        return back

    def _probe(self, llm: Any, e: int) -> None:
        from ..adapters.vllm.engine import worker_status

        if self.engine_infos[e].diagnostics:
            worker_status(llm)

    def refuse_dead(self) -> None:
        """Raise ``RefitFailed`` naming every engine this driver refuses (after readmitting any
        that answer again)."""
        self.readmit()
        if self.dead:
            raise RefitFailed("; ".join(self.dead_line(e) for e in sorted(self.dead)))

    # -- refits -------------------------------------------------------------------------------
    def request(self) -> RefitRequest:
        cfg = self.refit_config
        return RefitRequest(self.plan.digest(), cfg.verify, cfg.timeout_s, cfg.atomic, overlap=cfg.overlap,
                            delta=cfg.delta, delta_state_limit_bytes=cfg.delta_state_limit_bytes)

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
        """Every worker's serving state, version and last outcome (diagnostics extension)."""
        from ..adapters.vllm.engine import worker_status

        self.readmit()
        got: list[list[WorkerStatus]] = [[] for _ in self.engines]
        errors = [f"engine {e}: no diagnostics extension (worker_extension_cls) to ask its workers"
                  for e, info in enumerate(self.engine_infos) if not info.diagnostics]
        errors += self.on_engines(lambda llm, e: got[e].extend(worker_status(llm)), list(range(len(self.engines))),
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
        errors = self.on_engines(lambda llm, _: llm.shutdown_weight_transfer_engine(),
                                 what="shutdown_weight_transfer_engine", deadline_s=CLOSE_DEADLINE_S)
        if errors:
            _log.warning("closing the refit driver: %s", "; ".join(errors))


def with_draft_tensors(side: SideLayout, spec: ModelSpec) -> SideLayout:
    """``side`` with the MTP layers' canonical tensors in its table where it holds any of them
    (a trainer built with megatron's MTP block, an engine that runs the draft)."""
    if not spec.mtp_layers:
        return side
    draft = draft_tensors(spec)
    if not any(q.canonical in draft for q in side.pieces()):
        return side
    return replace(side, tensors={**side.tensors, **draft})


def check_adapter_shapes(src: SideLayout, tensors: dict, peft: PeftConfig) -> None:
    """Every adapter matrix the training ranks hold has the shape ``peft`` gives it (``dim``):
    one line naming the first that does not, before anything is planned."""
    extent: dict[str, list[int]] = {}
    for q in src.pieces():
        if q.canonical in tensors:
            e = extent.setdefault(q.canonical, [0] * len(q.box.offsets))
            for i, (o, n) in enumerate(zip(q.box.offsets, q.box.sizes)):
                e[i] = max(e[i], o + n)
    for name, held in extent.items():
        want = list(tensors[name][0])
        if held != want:
            raise ConfigError(f"peft.dim={peft.dim}: the training ranks hold {name} as {held}, the settings say {want}")


class ReshardTransport:
    """Shard to shard (the default transport): every trainer endpoint and every engine at
    once; they vote, one decision is written, all commit or none does. After a failure the
    refit group is rebuilt at the next refit.

    No engine ever serves a mix of old and new weights. Each engine's scheduler is paused
    (vLLM's own ``sleep(level=0)``) for the refit; afterwards the driver reads every worker's
    state and version (with a deadline): an engine whose workers all hold the new version --
    or, after a failed refit, all still the old one -- resumes; one whose workers disagree,
    that cannot learn the decision, that streamed part of a failed refit, or that cannot
    confirm, stays paused (**gated**: no model step runs for any client -- ``generate``,
    ``enqueue``, ``AsyncLLM``, a server -- since they all meet in vLLM's scheduler) until a
    refit succeeds. An engine that does not answer within its deadline is dead for the driver:
    the refit says so in one line, and later refits refuse it until it is replaced. A plain
    engine (no diagnostics extension) cannot be asked: the refit's own outcome decides."""

    name = "reshard"
    worker_extension: str | None = None

    def refit(self, driver: RefitDriver, request: RefitRequest, faults: Faults | None) -> RefitMetrics:
        if request.overlap:
            return self.begin(driver, request, faults).finish()
        cached = driver.ensure_connected()
        epoch = driver.next_epoch()
        request = replace(request, epoch=epoch)
        refit = driver.refit_id(request)
        faults = faults or Faults()
        t0 = time.perf_counter()
        errors = driver.on_engines(lambda llm, _: llm.sleep(level=0, mode="keep"), what="pause", deadline_s=60.0)
        refitting = driver.trainers.refit(request, faults.trainer)
        update_info = _update_info(request, faults)

        def update(llm: Any, _: Any) -> None:
            llm.start_weight_update()
            try:
                llm.update_weights({"update_info": update_info})
            except BaseException as exc:
                if not engine_is_dead(exc):  # a dead engine never answers again: do not wait on it
                    finish_quietly(llm)
                raise
            finish_update(llm)  # the commit, as the vote decided

        updating = driver.start_on_engines(update, what="update_weights")
        replies, trainer_error = None, None
        try:
            # every trainer, not the first that fails: the grace below starts only once no
            # trainer is still waiting for the decision (nor, then, any worker that is alive)
            replies = refitting.wait(trainers_deadline(request), every=True)
        except Exception as exc:  # noqa: BLE001 - the trainers' error names every failing rank
            trainer_error = "; ".join(driver.trainers.dead() + [first_error_line(exc)])
        # Every trainer has read the decision (or died): a worker that read it too answers
        # within moments. One that does not within the grace is dead or stuck, and so is its
        # engine (vLLM's core waits on that worker's reply without a deadline).
        errors += driver.wait_on_engines(updating, driver.engine_grace_s)
        seconds = time.perf_counter() - t0
        trusted = trainer_error is None and not errors
        errors += self.settle(driver, request, refit, trusted)
        return self.result(driver, request, replies, trainer_error, errors, seconds,
                          time.perf_counter() - t0, cached)

    def begin(self, driver: RefitDriver, request: RefitRequest, faults: Faults | None) -> "PendingRefit":
        """An overlapped refit's first half: the trainers start sending and every engine's
        ``update_weights`` returns at once (its workers receive on their own threads)."""
        cached = driver.ensure_connected()
        request = replace(request, epoch=driver.next_epoch())
        faults = faults or Faults()
        t0 = time.perf_counter()
        refitting = driver.trainers.refit(request, faults.trainer)
        update_info = _update_info(request, faults)

        def start(llm: Any, _: Any) -> None:
            llm.start_weight_update()
            llm.update_weights({"update_info": update_info})

        errors = driver.on_engines(start, what="update_weights (overlapped)", deadline_s=60.0)
        return PendingRefit(self, driver, request, refitting, errors, t0, cached)

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

    def settle(self, driver: RefitDriver, request: RefitRequest, refit: str, trusted: bool) -> list[str]:
        """After the vote: confirm each engine's workers, then resume the whole ones and keep
        the others gated (paused). Returns one line per engine gated or dead.

        A gated engine resumes only on "new": a refit of this driver that committed on all of
        its workers. What makes an engine unsafe stays with its workers (an ``unsure`` or torn
        worker, workers holding different refits) until such a refit, so a new driver reaches
        the same verdict as the one that gated it."""
        out: list[str] = []
        version = request.label(refit)
        for e, llm in enumerate(driver.engines):
            if e in driver.dead:
                continue
            verdict = self._confirm(driver, e, refit, trusted)
            if e in driver.dead:  # it died or stopped answering during the refit: nothing to resume
                out.append(driver.dead_line(e))
                continue
            if verdict == "old" and e in driver.gated:
                verdict = driver.gated[e]  # gated earlier: only "new" resumes it
            if verdict in ("new", "old"):
                driver.gated.pop(e, None)
                steps = [lambda: self._reset_prefix_cache(driver, e, llm), lambda: llm.update_weight_version(version)] \
                    if verdict == "new" else []
                steps.append(lambda: llm.wake_up(tags=["scheduling"]))
                for step in steps:
                    out += driver.on_engines(lambda _l, _a, fn=step: fn(), only=e, what="resume", deadline_s=60.0)
            else:
                driver.gated[e] = verdict
                out.append(f"engine {e} is gated (paused, serving nothing) until a refit succeeds: {verdict}")
        return out

    @staticmethod
    def _reset_prefix_cache(driver: RefitDriver, e: int, llm: Any) -> None:
        """KV blocks computed with the old weights: with ``recompute_kv_cache_after_weight_updates``
        running requests are preempted and recomputed, so the reset always succeeds; without,
        vLLM resets only when no request holds blocks, and the refit's notes say when it could
        not (a running request's blocks stay cached for later prompts with that prefix)."""
        recompute = driver.refit_config.recompute_kv_cache_after_weight_updates
        if llm.reset_prefix_cache(reset_running_requests=recompute) is False:
            driver.notes.append(f"engine {e}: prefix cache not reset (requests running across the swap hold KV "
                                f"blocks computed with the old weights; refit.recompute_kv_cache_after_weight_updates"
                                f"=false keeps them)")

    def _confirm(self, driver: RefitDriver, e: int, refit: str, trusted: bool) -> str:
        """"new" when every worker holds refit ``refit`` whole, "old" when (the refit failed
        and) every worker holds one same earlier refit whole, else why not (one line)."""
        from ..adapters.vllm.engine import worker_status

        got: list[list[WorkerStatus]] = []
        errs = ["no diagnostics extension"] if not driver.engine_infos[e].diagnostics else driver.on_engines(
            lambda x, _: got.append(worker_status(x)), only=e, what="confirm", deadline_s=30.0)
        if errs or not got:
            if e in driver.dead:
                return driver.dead[e]
            # A plain engine (or one that cannot answer): the refit's own success is the only evidence.
            return "new" if trusted else "its workers cannot be asked which weights they hold"
        states = got[0]
        bad = [f"worker {w}: {st.state} ({st.reason[:200]})" for w, st in enumerate(states) if st.state != "serving"]
        if bad:
            return "; ".join(bad)
        held = {st.refit for st in states}
        if len(held) != 1:
            return "its workers hold the weights of different refits: " + ", ".join(
                f"worker {w}: {st.version or 'as loaded'} (refit {st.refit or 'none'})" for w, st in enumerate(states))
        holds = held.pop()
        if holds == refit:
            return "new"
        return "old" if not trusted else f"its workers hold refit {holds or 'none (as loaded)'}, not {refit}"


class PendingRefit:
    """An overlapped refit between :meth:`RefitDriver.begin_refit` and :meth:`finish`: the
    engines serve their old weights while the new ones arrive in their shadows."""

    def __init__(self, transport: ReshardTransport, driver: RefitDriver, request: RefitRequest, refitting: Any,
                 errors: list[str], t0: float, cached: bool) -> None:
        self.transport, self.driver, self.request = transport, driver, request
        self._refitting, self._errors, self._t0, self._cached = refitting, errors, t0, cached
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
        replies, trainer_error = None, None
        try:
            replies = self._refitting.wait(trainers_deadline(request), every=True)
        except Exception as exc:  # noqa: BLE001 - the trainers' error names every failing rank
            trainer_error = "; ".join(driver.trainers.dead() + [first_error_line(exc)])
        seconds = time.perf_counter() - self._t0
        t_pause = time.perf_counter()
        errors = list(self._errors)
        errors += driver.on_engines(lambda llm, _: llm.sleep(level=0, mode="keep"), what="pause", deadline_s=60.0)
        errors += driver.on_engines(lambda llm, _: finish_update(llm), what="finish_weight_update (swap)",
                                    deadline_s=driver.engine_grace_s + 30.0)
        trusted = trainer_error is None and not errors
        errors += self.transport.settle(driver, request, driver.refit_id(request), trusted)
        return self.transport.result(driver, request, replies, trainer_error, errors, seconds,
                                    time.perf_counter() - t_pause, self._cached)


def trainers_deadline(request: RefitRequest) -> float:
    """How long the driver waits for the trainers' refit replies: the refit's own timeout (a
    silent peer's), the decision's grace past it, and a margin for the replies to arrive. The
    trainers' own waits all end by then, so the driver's error is theirs, never its own
    timeout racing them."""
    return request.timeout_s + 30.0


def _update_info(request: RefitRequest, faults: Faults) -> dict:
    """The engines' ``update_info``: the request, and the engine side's fault (tests only)."""
    return EngineUpdateInfo(request, faults.engine).to_wire()


