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

The refit's sequence is ``transport.participant.RefitEndpoint``'s, with :class:`VllmApplier` as
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

Its parts, each in this package: ``pieces.EnginePieces`` (what the worker holds: the target's,
the draft's and the LoRA slots' pieces), ``slices.join_with_slice`` (the init: join, take the
plan slice, check it), ``pending`` (the refit between ``update_weights`` and
``finish_weight_update``, overlapped on a thread of its own) and ``standing.Standing`` (the
version held, ``status()``).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from ....errors import RefitError
from ....layout.descriptor import LocalParam
from ....layout.lora import PeftConfig
from ....transport.participant import RefitEndpoint
from ....wire.protocol import Canary, EngineInitInfo, EngineUpdateInfo, RankReport, VerifyMode, WorkerStatus, first_error_line
from ..apply import VllmApplier
from ..sinks import AlteredBaseline, refit_sink
from ..canary import CanaryFailed, check_canary, draft_logprobs, engine_logprobs, unsupported
from ..layers import untie_head
from .pending import Background, Received, Unreadable, Voted, wants_overlap
from .pieces import EnginePieces
from .slices import join_with_slice
from .standing import Standing

__all__ = ["ReshardWeightTransferEngine", "Unreadable", "engine_rank", "rebind_commits"]


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
        self.pieces = EnginePieces(model, vllm_config, device, self.local_rank)
        self.standing = Standing()
        self._applier: VllmApplier | None = None
        #: This rank's report of the last refit (diagnostics).
        self.last_report: RankReport | None = None
        #: Model-format copy of what the last ``verify=full`` refit received, by local name.
        self.received: dict[str, torch.Tensor] | None = None
        #: The refit between ``update_weights`` and ``finish_weight_update`` (``pending``).
        self._pending: Voted | Background | None = None

    # -- descriptors ------------------------------------------------------------------------
    def params(self) -> list[LocalParam]:
        """This worker's destination pieces (``pieces.EnginePieces``: recorded once each)."""
        return self.pieces.params()

    @property
    def served(self) -> torch.nn.Module:
        """The module tree a refit writes: the target, and the draft under ``draft`` once known."""
        return self.pieces.served

    def set_weight_update_target(self, model: torch.nn.Module, model_config: Any) -> None:
        """vLLM's draft session names the draft model: kept, and from now on part of every refit."""
        super().set_weight_update_target(model, model_config)
        self.pieces.name_draft(model)

    def install_adapter(self, peft: PeftConfig) -> None:
        """A LoRA policy's refit adapter in this worker's LoRA slots (``lora_slots``; once)."""
        self.pieces.install_adapter(peft)

    def applier(self, atomic: bool) -> VllmApplier:
        """This worker's participant for a refit in mode ``atomic``: kept while the mode and the
        pieces stay; a new one inherits a torn model's gate."""
        ap = self._applier
        params = self.params()
        if ap is None or ap.atomic != atomic or set(ap.params) != {p.name for p in params}:
            new = VllmApplier(self.served, params, atomic=atomic, device=self.device,
                              rebind=rebind_commits(self.vllm_config, self.device), probe=self.canary)
            if ap is not None:
                new.inherit(ap)  # a torn model stays gated across a change of mode
            ap = self._applier = new
        return ap

    def canary(self, canary: Canary | None, every: bool = False) -> None:
        """The canary vote's forward on this worker (``VllmApplier.probe``): the engine's own
        model on the canary's sequences, over whatever weights a forward reads now. Every
        worker of the engine runs it (its collectives); the engine's first worker alone judges
        it, so a failure is one line -- ``every``: each worker does (an overlapped refit's
        swap, where each decides for itself). ``None``: only whether this engine can run one."""
        who = self.engine_name()
        why = unsupported(self.vllm_config)
        if why:
            raise CanaryFailed(f"{who}: refit.canary is on, but {why}")
        if canary is None:
            return
        hidden: list[torch.Tensor] = []
        got = engine_logprobs(self.vllm_config, self._default_model, self.device, canary.tokens, canary.scored(),
                              hidden)
        if every or self.local_rank == 0:
            check_canary(canary, got, who)
        draft = self.pieces.draft
        if canary.draft and draft is not None:  # the engine drafts: its draft is checked too
            got = draft_logprobs(self.vllm_config, draft, self.device, canary.tokens, hidden, canary.draft_targets)
            if every or self.local_rank == 0:
                check_canary(canary, got, who, draft=True)

    def engine_name(self) -> str:
        """This worker's engine, by the destination ranks it holds in the refit group."""
        world = int(self.vllm_config.parallel_config.world_size)
        if self.endpoint is None:
            return f"vLLM worker {self.local_rank}"
        first = self.endpoint.rank - self.local_rank % world
        return f"engine of destination ranks {first}..{first + world - 1}"

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
        worker records itself (``slices.join_with_slice``). Never raises: a refusal is kept
        as ``init_error`` and this worker's first refit votes no with it, before a byte moves."""
        self.drain_pending()  # a refit voted in the old group is concluded there, as it was decided
        refusal = ""
        if init_info.lora is not None:
            try:
                self.install_adapter(init_info.lora)
            except Exception as exc:  # noqa: BLE001 - reported by this worker's first vote
                refusal = first_error_line(exc)
        if self.endpoint is not None:
            self.endpoint.leave()
        self.endpoint = join_with_slice(init_info, self.local_rank, self.device, self.params, refusal)
        self.standing.init_error = self.endpoint.refusal

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
        if wants_overlap(update_info):
            self._pending = Background(lambda: self._receive(update_info), self.vllm_config,
                                       update_info.request.timeout_s, self.local_rank)
        else:
            self._pending = Voted(self._receive(update_info))

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
        got = pending.join()
        outcome = got.outcome
        if got.request is not None and got.applier is not None and self.endpoint is not None:
            outcome = self.endpoint.conclude(outcome, got.applier)
        self.standing.concluded(got.request, outcome)
        if self._applier is not None:  # the worker's own gate: no model step while unsure
            self._applier.unsure = self.standing.unsure
        if (outcome.commit and outcome.known) or quiet or not self._last_worker():
            return
        word = "not committed" if outcome.known else "decision unknown (this engine must not serve)"
        raise RefitError(f"refit {word}: {'; '.join(outcome.errors)[:800]}")

    def _last_worker(self) -> bool:
        world = int(self.vllm_config.parallel_config.world_size)
        return self.local_rank % world == world - 1

    def _receive(self, update_info: EngineUpdateInfo | Unreadable) -> Received:
        """Receive, prepare and vote (``RefitEndpoint.transfer_and_vote``, with the applier as
        this worker's participant and the sinks the request asks for around it)."""
        if isinstance(update_info, Unreadable):
            return Received.refused(update_info.error)
        if self.model is not self._default_model:
            return Received.refused(
                f"vLLM worker {self.local_rank}: mcore_reshard moves the draft with the target, in one refit: a "
                f"draft session only names the draft (start_draft_weight_update, then finish_weight_update)")
        request = update_info.request
        if self.endpoint is None:
            return Received.refused(f"vLLM worker {self.local_rank}: update_weights before init_weight_transfer_engine",
                                    epoch=request.epoch)
        fault = update_info.fault if update_info.fault is not None and update_info.fault.strikes(self.endpoint.rank) \
            else None
        applier = self.applier(request.atomic)
        applier.shadows.skip_processing = frozenset(
            [fault.skip_processing] if fault is not None and fault.skip_processing else [])
        applier.shadows.skip_absorption = fault is not None and fault.skip_absorption
        if fault is not None and fault.untie_head:
            untie_head(self._default_model)
        participant: Any = applier
        sink, self.received = refit_sink(applier.sink, request.verify is VerifyMode.FULL, fault)
        if fault is not None and fault.alter_baseline is not None:
            participant = AlteredBaseline(applier, applier.sink, fault.alter_baseline)
        outcome, self.last_report = self.endpoint.transfer_and_vote(
            request, {}, sink, participant, fault=fault.fault if fault is not None else None)
        return Received(request, applier, outcome)

    def forget_baselines(self) -> None:
        """The weights change outside a refit (e.g. the HF baseline's reload): no delta may
        start from what this worker held before, so the next refit is full; and the worker
        no longer holds any refit's weights (its standing is "as loaded": a driver that
        leaves frozen weights out of its refits sees that they may have changed)."""
        self.standing.version = self.standing.refit = ""
        if self.endpoint is not None:
            self.endpoint.delta.reset()
        if self._applier is not None:
            self._applier.sink.forget_baselines()

    def status(self) -> WorkerStatus:
        """This worker's serving state, the version it holds and the last refit's outcome
        (``standing.Standing.status``)."""
        return self.standing.status(self._applier)

    def shutdown(self) -> None:
        if self.endpoint is not None:
            self.endpoint.leave()
            self.endpoint = None
