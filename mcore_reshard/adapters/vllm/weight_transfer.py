"""The inference end of a refit: a vLLM weight-transfer engine named ``mcore_reshard``.

A user of plain vLLM turns it on with ``LLM(..., weight_transfer_config={"backend":
"mcore_reshard"})`` (the ``vllm.general_plugins`` entry point registers it in every worker)
and drives it with vLLM's own calls:

    llm.init_weight_transfer_engine({"init_info": EngineInitInfo(join, digest, slices).to_wire()})
    # once per layout; or slice_digests={rank: digest} instead of slices: each worker reads its
    # own slice from the refit group's store after joining (``slice_store``; the message stays small)
    llm.start_weight_update()                                                  # opens
    llm.update_weights({"update_info": EngineUpdateInfo(request).to_wire()})   # receives, prepares, votes
    llm.finish_weight_update()                                                 # commits or rolls back
    llm.reset_prefix_cache()   # KV blocks computed with the old weights

The refit's sequence is ``transport.endpoint.RefitEndpoint``'s, with :class:`VllmApplier` as
this worker's participant (vLLM's layerwise reload into shadows where the kernel repacks, in
place or staged where it keeps model format). Every rank of the refit (trainers and every
engine's workers) votes over the group's control plane inside ``update_weights``, and one
signed decision is written before anyone commits: all commit or none does
(``RefitRequest.atomic``), so an engine never serves a model no one trained. The outcome and
every rank's ``RankReport`` reach the trainer endpoints through that same vote (vLLM's engine
API has no channel back). On the engine side a refit that did not commit raises from
``finish_weight_update`` on the engine's last worker only (an error from any other worker
would poison vLLM's next RPC), and every worker keeps its state and the version it holds
(``status()``, read by the driver to confirm an engine is whole).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from vllm.config import set_current_vllm_config
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from ...errors import RefitError
from ...layout.descriptor import DTYPE_BYTES, LocalParam
from ...layout.spec import ModelSpec, spec_from_hf_config
from ...wire.protocol import (EngineInitInfo, EngineUpdateInfo, RankReport, RefitRequest, VerifyMode, WorkerStatus,
                              first_error_line)
from ...wire.slice_store import fetch_slice
from ...transport.endpoint import Outcome, RefitEndpoint
from ...wire.faults import Fault
from ...layout.lora import PeftConfig
from .apply import VllmApplier
from .layers import TargetAndDraft
from .lora_slots import install_refit_adapter
from .parallel import VllmParallel
from .record import record_local_params
from .sinks import AlteredBaseline, refit_sink

__all__ = ["ReshardWeightTransferEngine", "Unreadable", "canonical_tensors", "engine_rank", "rebind_commits"]


@dataclass(frozen=True)
class Unreadable:
    """An ``update_info`` this worker could not read: its vote is "no" with ``error`` (raising
    from ``update_weights`` on one worker would poison vLLM's next call)."""

    error: str


def served_spec(vllm_config: Any) -> ModelSpec:
    """The served model's spec, from its HF config, in the engine's dtype."""
    mc = vllm_config.model_config
    return spec_from_hf_config(mc.hf_config, dtype=str(mc.dtype).replace("torch.", ""))


def canonical_tensors(vllm_config: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """Canonical HF tensors (name -> shape, dtype) of the served model, from its HF config."""
    return served_spec(vllm_config).tensor_table()


def rebind_commits(vllm_config: Any, device: torch.device) -> bool:
    """Whether a commit may rebind live tensors to the shadows' storages (``VllmApplier.rebind``):
    a CPU engine run eagerly, where nothing holds the live storages."""
    return torch.device(device).type == "cpu" and bool(getattr(vllm_config.model_config, "enforce_eager", False))


def engine_rank() -> int:
    """This worker's rank inside its engine (vLLM's world group)."""
    from vllm.distributed.parallel_state import get_world_group

    return int(get_world_group().rank_in_group)


class ReshardWeightTransferEngine(WeightTransferEngine[EngineInitInfo, EngineUpdateInfo]):
    """vLLM's worker-side engine (see the module docstring). Its init info and update info are
    the project's own messages, ``wire.protocol.EngineInitInfo`` and ``EngineUpdateInfo``,
    read from vLLM's dicts by their ``from_wire``: one type per message."""

    init_info_cls = EngineInitInfo
    update_info_cls = EngineUpdateInfo
    #: vLLM's draft session (``start_draft_weight_update``) only tells this engine where the
    #: draft is (``set_weight_update_target``): from then on every refit moves the target and
    #: the draft together, in one vote. A draft session that sends weights is refused.
    supports_draft_weight_update = True
    #: ``update_weights`` votes; the weights go live at ``finish_weight_update`` (or ``drain_pending``).
    defers_processing = True
    #: vLLM closes this engine's session when its ``finish_weight_update`` raises (``session.py``).
    closes_failed_sessions = True

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.endpoint: RefitEndpoint | None = None
        self.local_rank = engine_rank()
        self._params: list[LocalParam] | None = None
        self._applier: VllmApplier | None = None
        #: The agreed outcome and this rank's report of the last refit (diagnostics).
        self.last_outcome: Outcome | None = None
        self.last_report: RankReport | None = None
        #: Model-format copy of what the last ``verify=full`` refit received, by local name.
        self.received: dict[str, torch.Tensor] | None = None
        #: The version label of this worker's weights (``RefitRequest.label``; "" = as loaded).
        self.version = ""
        #: The identity of the refit whose weights this worker holds (``Outcome.refit``; "" = as loaded).
        self.refit = ""
        #: Why this worker could not learn a refit's decision; kept until a refit commits here,
        #: so every later refit and driver sees this worker ``unsure`` until then.
        self.unsure = ""
        #: Why this worker refused its plan slice at init (its first refit votes no with it).
        self.init_error = ""
        #: The refit between ``update_weights`` and ``finish_weight_update``: voted, or (overlapped)
        #: receiving and voting on its own thread.
        self._pending: _Voted | _Background | None = None
        #: A LoRA policy's refit adapter (``lora_slots``): its slot tensors on this worker.
        self.adapter_params: list[LocalParam] = []
        #: The speculative-decoding draft (learnt from vLLM's draft session), its recorded
        #: pieces (local names ``draft.<name>``), and the tree that holds target and draft.
        self.draft: torch.nn.Module | None = None
        self._draft_params: list[LocalParam] | None = None
        self._served: torch.nn.Module = model

    # -- descriptors ------------------------------------------------------------------------
    def params(self) -> list[LocalParam]:
        """This worker's destination pieces, recorded once with vLLM's own loaders: the
        target's, the draft's once this engine knows it, and the slots of its refit adapter
        once one is installed."""
        if self._params is None:
            self._params = record_local_params(self._default_model, canonical_tensors(self.vllm_config),
                                               self.local_rank, vllm_config=self.vllm_config, device=self.device,
                                               checkpoint=served_spec(self.vllm_config).checkpoint_shapes())
        if self.draft is not None and self._draft_params is None:
            self._draft_params = self._record_draft()
        return self._params + (self._draft_params or []) + self.adapter_params

    def _record_draft(self) -> list[LocalParam]:
        """The draft's pieces, recorded with its own loader from the MTP layers' canonical
        tensors (``layout.mtp``), named ``draft.<name>``. Tensors it shares with the target
        (embedding, head) are the target's pieces: not recorded twice."""
        from dataclasses import replace

        from ...layout import Piece
        from ...layout.mtp import draft_tensors

        spec = served_spec(self.vllm_config)
        shared = {id(t) for t in self._default_model.parameters()}  # the same Parameter objects
        own = {n for n, t in self.draft.named_parameters() if id(t) not in shared}
        recorded = record_local_params(self.draft, draft_tensors(spec), self.local_rank, vllm_config=self.vllm_config,
                                       device=self.device)
        return [replace(p, name="draft." + p.name,
                        pieces=tuple(Piece(q.rank, "draft." + q.local_name, q.canonical, q.box, q.view)
                                     for q in p.pieces))
                for p in recorded if p.name in own]

    @property
    def served(self) -> torch.nn.Module:
        """The module tree a refit writes: the target, and the draft under ``draft`` once known."""
        return self._served

    def set_weight_update_target(self, model: torch.nn.Module, model_config: Any) -> None:
        """vLLM's draft session names the draft model: kept, and from now on part of every refit."""
        super().set_weight_update_target(model, model_config)
        if model is not self._default_model and model is not self.draft:
            self.draft, self._draft_params = model, None
            self._served = TargetAndDraft(self._default_model, model)

    def install_adapter(self, peft: PeftConfig) -> None:
        """A LoRA policy's refit adapter in this worker's LoRA slots (``lora_slots``; once)."""
        par = self.vllm_config.parallel_config
        self.adapter_params = install_refit_adapter(
            self._default_model, peft, served_spec(self.vllm_config),
            VllmParallel(tp=int(par.tensor_parallel_size), pp=int(par.pipeline_parallel_size)), self.local_rank)

    def applier(self, atomic: bool) -> VllmApplier:
        ap = self._applier
        params = self.params()
        if ap is None or ap.atomic != atomic or set(ap.params) != {p.name for p in params}:
            new = VllmApplier(self._served, params, atomic=atomic, device=self.device,
                              rebind=rebind_commits(self.vllm_config, self.device))
            if ap is not None:
                new.inherit(ap)  # a torn model stays gated across a change of mode
            ap = self._applier = new
        return ap

    # -- vLLM's lifecycle ---------------------------------------------------------------------
    def parse_init_info(self, init_dict: dict[str, Any]) -> EngineInitInfo:
        try:
            return EngineInitInfo.from_wire(init_dict)
        except Exception as exc:  # noqa: BLE001 - vLLM's contract: ValueError for a bad init_info
            raise ValueError(f"Invalid init_info for {type(self).__name__}: {first_error_line(exc)}") from exc

    def parse_update_info(self, update_dict: dict[str, Any]) -> EngineUpdateInfo | Unreadable:
        try:
            return EngineUpdateInfo.from_wire(update_dict)
        except Exception as exc:  # noqa: BLE001 - a bad request is this worker's "no"
            return Unreadable(f"vLLM worker {self.local_rank}: bad update_info: {first_error_line(exc)}")

    def init_transfer_engine(self, init_info: EngineInitInfo) -> None:
        """Join the refit group and keep this worker's plan slice, checked against what this
        worker records itself: every destination parameter the slice writes exists here and
        receives exactly its non-padding elements.

        Never raises (one worker raising in ``collective_rpc`` leaves the others' replies
        queued and poisons the engine's next call): a slice this worker refuses is kept as
        ``init_error``, the worker still joins, and its first refit votes no with that line
        before a byte moves."""
        self.drain_pending()  # a refit voted in the old group is concluded there, as it was decided
        message = init_info
        info = message.join
        rank = info.dst_offset + self.local_rank
        endpoint = RefitEndpoint("dst", rank, self.device)
        self.init_error = ""
        if message.lora is not None:
            try:
                self.install_adapter(message.lora)
            except Exception as exc:  # noqa: BLE001 - reported by this worker's first vote
                self.init_error = first_error_line(exc)
        wire = message.slices.get(rank)
        by_digest = message.slice_digests.get(rank) if wire is None else None
        if by_digest is None:
            self._take_slice(endpoint, rank, wire, message.plan_digest)
        if self.endpoint is not None:
            self.endpoint.leave()
        self.endpoint = endpoint
        try:
            endpoint.join(info)
        except Exception as exc:  # noqa: BLE001 - a worker without a group votes no at its refit
            self.init_error = self.init_error or f"{endpoint.who}: joining the refit group failed: {first_error_line(exc)}"
        if by_digest is not None and endpoint.group is not None:
            try:
                wire = fetch_slice(endpoint.group.store, str(by_digest), info.timeout_s, endpoint.who)
            except Exception as exc:  # noqa: BLE001 - reported by this worker's first vote
                self.init_error = first_error_line(exc)
            else:
                self._take_slice(endpoint, rank, wire, message.plan_digest)
        endpoint.refusal = self.init_error  # its first refit votes no with it, before a byte moves

    def _take_slice(self, endpoint: RefitEndpoint, rank: int, wire: dict[str, Any] | None, digest: str) -> None:
        """Keep ``wire`` as this worker's slice once it is checked; a refusal is kept as
        ``init_error`` (never raised: see ``init_transfer_engine``)."""
        try:
            if wire is None:
                raise RefitError(f"vLLM destination rank {rank}: the init info carries no plan slice "
                                 f"(nor a slice digest) for it")
            endpoint.set_plan(wire, digest)
            self._check_slice(endpoint, rank, digest)
        except Exception as exc:  # noqa: BLE001 - reported by this worker's first vote
            self.init_error = self.init_error or first_error_line(exc)  # the adapter's refusal is the cause

    def _check_slice(self, endpoint: RefitEndpoint, rank: int, digest: str) -> None:
        held = {p.name: p for p in self.params()}
        mine = {n: p.numel - p.padding for n, p in held.items()}
        # Tensors carried as their bits (``RankPlan.reinterpret``) are counted in wire elements.
        s = endpoint.slice
        for name, real in s.reinterpret:
            if name in held:
                if held[name].dtype != real:
                    raise RefitError(f"vLLM destination rank {rank}: plan {digest} carries {name!r} as {real} bits, "
                                     f"this worker holds it in {held[name].dtype}")
                mine[name] *= DTYPE_BYTES[real] // DTYPE_BYTES[s.dtype]
        got: dict[str, int] = {}
        for t in s.transfers:
            if t.dst_name not in mine:
                raise RefitError(f"vLLM destination rank {rank}: plan {digest} writes {t.dst_name!r}, "
                                 f"which this worker does not hold")
            got[t.dst_name] = got.get(t.dst_name, 0) + t.box.numel
        bad = [n for n, k in got.items() if k != mine[n]]
        if bad:
            raise RefitError(f"vLLM destination rank {rank}: plan {digest} writes {got[bad[0]]} elements of "
                             f"{bad[0]!r}, this worker holds {mine[bad[0]]}")
        bits = dict(s.reinterpret)
        other = next((n for n in got if n not in bits and held[n].dtype != s.dtype), None)
        if other is not None:  # the wire would cast into it: not the weights the trainers verified
            raise RefitError(f"vLLM destination rank {rank}: plan {digest} carries {other!r} as {s.dtype}, this "
                             f"worker holds it in {held[other].dtype} (plan against the engine's dtype)")

    # The refit's sequence is ``RefitEndpoint``'s (open, move, prepare, vote, commit | abort);
    # the applier is this worker's participant. vLLM's three calls split it at the vote:
    def start_weight_update(self) -> None:
        """Open a weight update. A refit left without its ``finish_weight_update`` (its driver
        went away after ``update_weights``) is concluded first, as its vote decided: every
        worker of the engine runs this same call, so they all conclude alike."""
        self.drain_pending()

    def receive_weights(self, update_info: EngineUpdateInfo | Unreadable) -> None:
        """``update_weights``: receive this worker's boxes (into staged or shadow tensors;
        streaming: live), prepare them and vote with every rank of the refit. Nothing is
        committed here in atomic mode, and nothing raises: the outcome waits for
        ``finish_weight_update`` (``defers_processing``).

        ``RefitRequest.overlap``: returns at once. A thread of this worker receives into
        shadow weights and votes while the engine keeps running model steps on the live
        ones; ``finish_weight_update`` joins it."""
        self.drain_pending()  # an update_weights whose finish never came
        if _wants_overlap(update_info):
            self._pending = _Background(self, update_info)
        else:
            self._pending = _Voted(self._receive(update_info))

    def finish_weight_update(self) -> None:
        """Commit (the swap from staged and shadow tensors into the live ones) or roll back,
        as the vote decided; an overlapped refit is joined first. Every TP rank runs this call
        between the same two model steps (vLLM's workers read one queue in order), so the
        swap is one step boundary.

        It raises only on the engine's last worker, and only when the refit did not commit
        here: vLLM's ``collective_rpc`` reads the workers' replies in rank order, so an error
        from the last one leaves no reply queued, and the caller (the driver, or an HTTP
        controller's ``/finish_weight_update``) sees the failure in one line. Every worker
        keeps the outcome (``status()``)."""
        self._conclude(quiet=False)

    def drain_pending(self) -> None:
        """Conclude the refit under way (commit or roll back, as voted) without raising: for
        a caller that takes over the update tail (vLLM's ``defers_processing`` contract);
        ``status()`` says how it ended."""
        self._conclude(quiet=True)

    def _conclude(self, quiet: bool) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        request, applier, outcome = pending.join()
        if request is not None and applier is not None and self.endpoint is not None:
            outcome = self.endpoint.conclude(outcome, applier)
            if outcome.commit and outcome.known:  # this worker now holds that refit's weights, whole
                self.version, self.refit, self.unsure = request.label(outcome.refit), outcome.refit, ""
        self.last_outcome = outcome
        if not outcome.known:
            self.unsure = "; ".join(outcome.errors)[:500] or "the decision of a refit is unknown here"
        if self._applier is not None:  # the worker's own gate: no model step while unsure
            self._applier.unsure = self.unsure
        if (outcome.commit and outcome.known) or quiet or not self._last_worker():
            return
        word = "not committed" if outcome.known else "decision unknown (this engine must not serve)"
        raise RefitError(f"refit {word}: {'; '.join(outcome.errors)[:800]}")

    def _last_worker(self) -> bool:
        par = self.vllm_config.parallel_config
        world = int(par.world_size)
        return self.local_rank % world == world - 1

    def _receive(self, update_info: EngineUpdateInfo | Unreadable) -> tuple[RefitRequest | None, VllmApplier | None,
                                                                          Outcome]:
        """Receive, prepare and vote (``RefitEndpoint.transfer_and_vote``, with the applier as
        this worker's participant and the sinks the request asks for around it)."""
        if isinstance(update_info, Unreadable):
            return None, None, Outcome(False, [], [update_info.error])
        if self.model is not self._default_model:
            return None, None, Outcome(False, [], [
                f"vLLM worker {self.local_rank}: mcore_reshard moves the draft with the target, in one refit: a "
                f"draft session only names the draft (start_draft_weight_update, then finish_weight_update)"])
        request = update_info.request
        if self.endpoint is None:
            return None, None, Outcome(
                False, [], [f"vLLM worker {self.local_rank}: update_weights before init_weight_transfer_engine"],
                epoch=request.epoch)
        rank = self.endpoint.rank
        fault = update_info.fault if update_info.fault is not None and update_info.fault.strikes(rank) else None
        applier = self.applier(request.atomic)
        participant: Any = applier
        sink, self.received = refit_sink(applier.sink, request.verify is VerifyMode.FULL, fault)
        if fault is not None and fault.alter_baseline is not None:
            participant = AlteredBaseline(applier, applier.sink, fault.alter_baseline)
        outcome, self.last_report = self.endpoint.transfer_and_vote(
            request, {}, sink, participant, fault=fault.fault if fault is not None else None)
        return request, applier, outcome

    def forget_baselines(self) -> None:
        """The weights change outside a refit (e.g. the HF baseline's reload): no delta may
        start from what this worker held before, so the next refit is full."""
        if self.endpoint is not None:
            self.endpoint.delta.reset()
        if self._applier is not None:
            self._applier.sink.forget_baselines()

    def status(self) -> WorkerStatus:
        """This worker's serving state, the version it holds and the last refit's outcome.

        ``state``: ``serving`` (whole weights of ``version``), ``not_serving`` (a streaming
        refit committed part of the weights and then failed), ``unsure`` (this worker could
        not learn the last refit's decision; it kept its old weights, but others may not)."""
        ap = self._applier
        state, reason = ("serving", "") if ap is None else (ap.state if ap.state != "updating" else "serving", ap.reason)
        out = self.last_outcome
        if self.unsure and state == "serving":
            state, reason = "unsure", self.unsure
        return WorkerStatus(state, reason, self.version, None if out is None else bool(out.commit and out.known),
                            None if out is None else out.known, () if out is None else tuple(out.errors),
                            self.init_error, self.refit)

    def shutdown(self) -> None:
        if self.endpoint is not None:
            self.endpoint.leave()
            self.endpoint = None


def _wants_overlap(update_info: EngineUpdateInfo | Unreadable) -> bool:
    """Whether the request asks for an overlapped refit (an unreadable one is refused in the
    foreground)."""
    return isinstance(update_info, EngineUpdateInfo) and update_info.request.overlap and update_info.request.atomic


@dataclass(frozen=True)
class _Voted:
    """A refit that voted in the foreground (``update_weights``), waiting for its commit."""

    result: tuple[Any, ...]

    def join(self) -> tuple[Any, ...]:
        return self.result


class _Background:
    """One overlapped refit on its own thread: receive into shadow weights and vote, while
    the worker's main thread keeps running model steps on the live weights."""

    def __init__(self, engine: "ReshardWeightTransferEngine", update_info: EngineUpdateInfo) -> None:
        self.engine = engine
        self.timeout_s = float(update_info.request.timeout_s)
        self.result: tuple[Any, ...] | None = None

        def run() -> None:
            try:
                with set_current_vllm_config(engine.vllm_config):
                    self.result = engine._receive(update_info)
            except BaseException as exc:  # noqa: BLE001 - kept as this worker's outcome
                self.result = (None, None, Outcome(False, [], [f"vLLM worker {engine.local_rank}: background "
                                                                        f"refit failed: {first_error_line(exc)}"]))

        self.thread = threading.Thread(target=run, daemon=True, name=f"mcore-reshard-refit-{engine.local_rank}")
        self.thread.start()

    def join(self) -> tuple[Any, ...]:
        """The thread's result, waiting at most the request's timeout and a grace: the vote
        has deadlines of its own, so a thread still running then is stuck. Its shadows are
        never swapped in (the outcome says so; the engine keeps its weights)."""
        self.thread.join(self.timeout_s + BACKGROUND_GRACE_S)
        if self.thread.is_alive() or self.result is None:
            e = self.engine
            return (None, None, Outcome(False, [], [
                f"vLLM worker {e.local_rank}: the background refit did not end within "
                f"{self.timeout_s + BACKGROUND_GRACE_S:.0f}s; its shadows are dropped"], known=False))
        return self.result


#: Seconds past a request's timeout that ``finish_weight_update`` waits for its background refit.
BACKGROUND_GRACE_S = 30.0

