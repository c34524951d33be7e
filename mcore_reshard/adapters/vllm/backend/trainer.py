"""The training end of a refit through vLLM's own trainer-side API (``backend="mcore_reshard"``).

A framework written against vLLM's ``TrainerWeightTransferEngine`` needs no project-specific
call: every training rank (a Megatron-Core rank, ``torch.distributed`` initialised) runs::

    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    engine = WeightTransferTrainerFactory.trainer_init(
        ReshardTrainerInitInfo(rank=rank, engine_tp=2),      # the vLLM engine's layout
        client=HTTPVLLMWeightSyncClient(url),                 # or RayVLLMWeightSyncClient, ...
        source=TrainerShards(TrainerEndpoint(model_chunks, spec)))
    engine.send_weights()                                     # every step, on every rank

What happens underneath is the project's own refit, shard to shard: at ``trainer_init`` every
rank describes its pieces (gathered over the trainers' default process group as JSON), every
rank plans the same plan (pure and deterministic) against the engine's layout by the rules,
rank 0 (vLLM's "sender") opens the refit group, publishes the engine's slices in its store
and initialises the engine through ``client``. Each ``send_weights`` is one refit: every rank
sends its own boxes while rank 0 drives ``start_weight_update`` / ``update_weights`` /
``finish_weight_update``; all ranks of both sides vote, and the engine commits at its finish
or keeps its old weights. The engine checks its slice against what its workers record, so a
layout stated wrongly here is refused in one line at the first refit.

vLLM's trainer API has no pause: the engine serves its old weights until the swap at
``finish_weight_update`` (one step boundary), and a worker that could not learn a refit's
decision refuses model steps until a refit commits (the applier's gate). One client
drives one engine (an engine's init info names its first destination rank). Each refit is the
same engine-side sequence as the driver's and the HTTP controller's (``transport.sequence``),
on the client as a destination (``client.WeightSyncClient``).

The two sides are planned with the driver's own function (``plan.refit_plans.plan_refit``), so
LoRA (``peft``: base and adapter first, the adapter only after the first commit), an MTP draft
(``engine_speculative_config``: the engine learns its draft through vLLM's draft session once,
then it moves with the target in one vote), a block-FP8 engine (``engine_quantization``:
quantized at the senders) and delta refits work here as through the driver. The engine's side
is laid out by the rules (``vllm_layout``, ``vllm_draft_rank_params``, ``vllm_lora_layout``):
vLLM's client cannot ask it what it holds. Settings the sides cannot hold together are refused
at ``trainer_init`` in one line (``check_features``), before the engine is called.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Iterator, Self

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
)

from ....errors import ConfigError, RefitFailed
from ....infra.ports import free_port
from ....layout import LayoutError, LocalParam, Piece, SideLayout
from ....layout.lora import PeftConfig, is_adapter_tensor
from ....layout.mtp import draft_tensors, with_draft
from ....plan.refit_plans import RefitPlans, moves_encoder, plan_refit
from ....plan.wire import slice_to_wire
from ....transport.destination import EngineCallers
from ....transport.sequence import EngineRefit, EngineRun
from ....transport.source import all_gather_json as _all_gather_json
from ....wire.protocol import (BACKEND, EngineInitInfo, EngineUpdateInfo, JoinInfo, RankMap, RefitRequest, VerifyMode,
                               WorkerLayout, first_error_line, refit_id)
from ....wire.canary import canary_precision, make_canary
from ....wire.slice_store import publish_slices, slice_digests
from ..lora_rules import vllm_lora_layout
from ..mtp_rules import vllm_draft_rank_params
from ..parallel import QUANTIZATIONS
from ..rules import VllmParallel, vllm_layout
from .client import WeightSyncClient

__all__ = ["TrainerShards", "ReshardTrainerInitInfo", "ReshardTrainerEngine"]

#: Seconds past a refit's timeout that rank 0 waits for the engine's calls.
CLIENT_GRACE_S = 30.0


@dataclass
class ReshardTrainerInitInfo(TrainerInitInfo):
    """The trainer side's settings, in vLLM's ``TrainerInitInfo`` form (``rank`` is vLLM's:
    this process's rank among the trainers, 0 drives the engine).

    ``host`` / ``port``: the refit group's master, trainer rank 0's address (port 0: a free
    one there). ``engine_*``: the vLLM engine's parallel layout (its tensor, pipeline and
    data parallel sizes, expert parallelism) and ``engine_dtype`` (None: the model's);
    ``allow_cast``: the trainers may hold another dtype (cast while packing, ``refit.allow_cast``).
    ``timeout_s``, ``verify``, ``atomic``, ``delta``: as ``RefitRequest``'s (``delta="auto"``:
    a refit after a commit under the same plan moves only what changed; each rank's
    ``RankReport.delta`` says what it sent, ``ReshardTrainerEngine.last_reports``).

    What the engine runs beyond a plain model, each as the engine was started:
    ``peft`` (a ``layout.lora.PeftConfig`` or its dict): a LoRA policy into an engine started
    with ``enable_lora`` (the first ``send_weights`` moves base and adapter, every later one the
    adapter only); ``engine_speculative_config`` (vLLM's ``speculative_config``, method ``mtp``):
    the engine drafts with the model's MTP layers, which move with the target in one vote;
    ``engine_quantization="fp8_per_block"``: a block-FP8 engine, quantized at the senders.

    ``canary`` (``refit.canary``; ``canary_bound`` 0: the engine precision's, ``canary_sequences``,
    ``canary_tokens``): every refit carries a deferred canary, whose reference each rank's
    endpoint computes after its last byte (``TrainerEndpoint(..., canary=policy.top_logprobs)``)."""

    backend: ClassVar[str] = BACKEND

    host: str = "127.0.0.1"
    port: int = 0
    engine_tp: int = 1
    engine_pp: int = 1
    engine_dp: int = 1
    engine_enable_ep: bool = False
    engine_dtype: str | None = None
    allow_cast: bool = False
    timeout_s: float = 120.0
    verify: str = "checksum"
    atomic: bool = True
    delta: str = "auto"
    bucket_bytes: int = 64 << 20
    peft: PeftConfig | dict | None = None
    engine_speculative_config: dict | None = None
    engine_quantization: str | None = None
    canary: bool = False
    canary_bound: float = 0.0
    canary_sequences: int = 2
    canary_tokens: int = 16


class TrainerShards(WeightSource):
    """A training rank's weights as vLLM's ``WeightSource``: the metadata of every canonical
    (HF-named) tensor of the model, and the names this rank holds pieces of. It yields no whole
    tensors: the ``mcore_reshard`` engine reads this rank's local shards through ``endpoint``
    (a Megatron-Core rank's ``adapters.megatron.endpoint.TrainerEndpoint``, or any endpoint with
    its calls: ``spec``, ``describe``, ``join``, ``set_plan``, ``refit``, ``group``,
    ``last_outcome``, ``leave``) and moves each box where it is held, never a gathered tensor."""

    def __init__(self, endpoint: Any) -> None:
        self.endpoint = endpoint

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, getattr(torch, dtype), tuple(shape))
                for name, (shape, dtype) in self.endpoint.spec.tensor_table().items()]

    def held_names(self) -> list[str]:
        return sorted({q.canonical for p in self.endpoint.describe() for q in p.pieces})

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise TypeError("TrainerShards yields no whole tensors: the mcore_reshard backend moves each rank's "
                        "local shards (use backend='mcore_reshard')")


class ReshardTrainerEngine(TrainerWeightTransferEngine[ReshardTrainerInitInfo]):
    """vLLM's trainer-side engine over a :class:`TrainerEndpoint` (see the module docstring)."""

    init_info_cls = ReshardTrainerInitInfo

    def __init__(self, *, client: Any, source: TrainerShards, is_sender: bool, plans: RefitPlans,
                 request: RefitRequest, host: str, port: int, peft: PeftConfig | None = None) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.endpoint = source.endpoint
        #: Both sides and the plans (``plan.refit_plans``: the driver's own planning).
        self.plans = plans
        #: The plan the next refit runs (its report: ``plan.report``; ``bytes_min``, ...): a LoRA
        #: policy's adapter plan once a full refit committed.
        self.plan = plans.plan
        self._request = request
        self._epoch = 0
        self._host, self._port = host, port  # port 0: a free one at every join
        self._peft = peft
        #: The engine's init info of the current refit group (rank 0 sends it at every join).
        self.engine_init_info: dict[str, Any] = {}
        #: The engine as a refit destination (rank 0 drives it).
        self.destination = WeightSyncClient(client, plans.plan.num_dst)

    @property
    def last_reports(self) -> list[Any]:
        """Every rank's ``RankReport`` of the last refit (both sides, by refit-group rank; None:
        no vote): bytes received and full, ``verified``, its delta part (``delta.on``, ...)."""
        return list(self.endpoint.last_reports)

    @classmethod
    def trainer_init(cls, init_info: ReshardTrainerInitInfo, *, client: Any,
                     source: WeightSource | None = None) -> Self:
        """Plan, open the refit group and initialise the engine (rank 0 through ``client``);
        called on every trainer rank at once. Settings the two sides cannot hold together are
        refused here in one line, on every rank, before the engine is called."""
        import torch.distributed as dist

        if not isinstance(source, TrainerShards):
            raise ConfigError(f"source: the {BACKEND} trainer engine needs a TrainerShards source (a rank's "
                              f"TrainerEndpoint), got {type(source).__name__}")
        if not dist.is_initialized():
            raise ConfigError(f"{BACKEND}: torch.distributed is not initialised on this trainer rank")
        if init_info.rank != dist.get_rank():
            raise ConfigError(f"init_info.rank={init_info.rank} but this process is rank {dist.get_rank()} of the "
                              f"trainers' default process group")
        ep = source.endpoint
        spec = ep.spec
        every = _all_gather_json(WorkerLayout(tuple(ep.describe())).to_wire())
        src = SideLayout("megatron-live", len(every),
                         tuple(p for rows in every for p in WorkerLayout.from_wire(rows).params), spec.tensor_table())
        peft, draft = check_features(init_info, spec, src, canary_source=getattr(ep, "canary", None) is not None,
                                     canary_draft_source=getattr(ep, "canary_draft", None) is not None)
        par = VllmParallel(tp=init_info.engine_tp, pp=init_info.engine_pp, dp=init_info.engine_dp,
                           enable_ep=init_info.engine_enable_ep, quantization=init_info.engine_quantization)
        engine_spec = spec.with_dtype(init_info.engine_dtype or spec.dtype)
        try:
            dst = vllm_layout(engine_spec, par)
            if draft:  # named as the engine's workers record their draft: draft.<name>
                dst = with_draft(dst, [_as_draft(p) for r in range(par.world_size)
                                       for p in vllm_draft_rank_params(engine_spec, par, r)], engine_spec)
            slots = None
            if peft is not None:
                dst, slots = _lora_wrapped(dst), vllm_lora_layout(engine_spec, par, peft)
            plans = plan_refit(src, dst, spec, engine_spec, peft=peft, slots=slots,
                               bucket_bytes=init_info.bucket_bytes, allow_cast=init_info.allow_cast)
        except LayoutError as exc:
            raise ConfigError(f"{BACKEND} trainer engine: {first_error_line(exc)}") from None
        canary = None
        if init_info.canary:
            canary = make_canary(spec.vocab, canary_precision(engine_spec.dtype, plans.plan),
                                 init_info.canary_sequences, init_info.canary_tokens, init_info.canary_bound,
                                 draft=draft)
        request = RefitRequest(plans.plan.digest(), VerifyMode(init_info.verify), init_info.timeout_s,
                               init_info.atomic, delta=init_info.delta, encoders=moves_encoder(plans.plan, spec),
                               canary=canary)
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, plans=plans, request=request,
                     host=init_info.host, port=init_info.port, peft=peft)
        if draft:  # the engine learns where its draft is (vLLM's draft session, nothing sent): every rank hears
            why = _Call(engine.destination.learn_draft).wait(init_info.timeout_s) if engine.is_sender else None
            why = _all_gather_json(why)[0]
            if why:
                raise RefitFailed(f"{BACKEND}: the engine's draft session failed: {why}")
        engine._connect()
        return engine

    def _connect(self) -> None:
        """(Re)build the refit group for the current plan, on every rank at once: a fresh nonce
        (and a free port, unless one was given) from rank 0; every rank joins while rank 0
        initialises the engine (the group forms only once both sides are in); rank 0 then
        publishes the engine's slices in the group's store."""
        plan = self.plan
        self._request = replace(self._request, plan_digest=plan.digest())
        src_slice = slice_to_wire(plan.for_rank("src", torch.distributed.get_rank()))
        dst_slices = {str(r): slice_to_wire(plan.for_rank("dst", r)) for r in range(plan.num_dst)}
        mine = {"port": self._port or free_port(self._host), "secret": secrets.token_hex(16),
                "nonce": secrets.token_hex(16)}
        first = _all_gather_json(mine)[0]  # rank 0's
        rank_map = RankMap.disaggregated(plan.num_src, plan.num_dst)
        join = JoinInfo(self._host, int(first["port"]), rank_map.world_size, rank_map, self._request.timeout_s,
                        secret=first["secret"], nonce=first["nonce"])
        self.engine_init_info = EngineInitInfo(join, self._request.plan_digest, slice_digests={
            int(r): d for r, d in slice_digests(dst_slices).items()}, lora=self._peft).to_wire()
        init = _Call(lambda: self.destination.join(self.engine_init_info)) if self.is_sender else None
        try:
            self.endpoint.join(join)
            self.endpoint.set_plan(src_slice, self._request.plan_digest)
            if self.is_sender:
                publish_slices(self.endpoint.group.store, dst_slices)
        finally:
            error = init.wait(join.timeout_s + CLIENT_GRACE_S) if init is not None else None
        if error:
            raise RefitFailed(f"{BACKEND}: init_weight_transfer_engine failed: {error}")

    def send_weights(self) -> None:
        """One refit: every rank sends its boxes and votes; rank 0 drives the engine's side of
        the refit meanwhile (``transport.sequence.EngineRefit``: start, update, then the
        conclusion labelled with the refit's identity). Raises ``RefitFailed`` on every rank,
        naming every failing rank, when the refit did not commit; the engine then kept its old
        weights (or, unsure, refuses to serve). A failed refit closes the refit group: the next
        one builds a new one first (on every rank, since any rank's failure counts). An engine
        call that fails on rank 0 stops every rank at once (``stop_everyone``)."""
        if any(_all_gather_json(self.endpoint.group is None)) or self._request.plan_digest != self.plan.digest():
            self.endpoint.leave()
            self._connect()
        self._epoch += 1
        request = replace(self._request, epoch=self._epoch)
        engines = starting = None
        if self.is_sender:
            refit = refit_id(request.plan_digest, self.endpoint.group.control.nonce, request.epoch)
            run = EngineRun(EngineUpdateInfo(request), request.label(refit), refit, grace_s=CLIENT_GRACE_S,
                            encoders=request.encoders)
            engines = EngineRefit(EngineCallers([self.destination]), run, abort=lambda why: self._stop(request, why))
            # on a thread: an abort waits for this rank's own refit to begin (the main thread's)
            starting = _Call(lambda: self._start(engines, request))
        error: BaseException | None = None
        try:
            self.endpoint.refit(request)
        except BaseException as exc:  # noqa: BLE001 - the engine's side is concluded first
            error = exc
        if engines is not None:
            client_error = starting.wait(request.timeout_s + CLIENT_GRACE_S)
            outcome = self.endpoint.last_outcome
            # (the outcome of this refit only: a rank that failed before its vote holds an older one)
            committed = outcome is not None and outcome.commit and outcome.epoch == request.epoch
            errors = [client_error] if client_error else []
            if starting.done and not client_error:  # its sessions are open: conclude them, as voted
                errors += engines.finish(trusted=committed)
            if errors and error is None:
                error = RefitFailed(f"{BACKEND}: the engine's calls failed: {'; '.join(errors)}")
        if error is not None:
            raise error
        # committed on every rank (the vote): a LoRA policy moves the adapter only from now on
        self.plan = self.plans.after_commit(self.plan)

    def _start(self, engines: EngineRefit, request: RefitRequest) -> None:
        """The engine's side up to its transfer; a refit it cannot begin stops every rank."""
        try:
            engines.start()
        except RefitFailed as exc:
            self._stop(request, first_error_line(exc))
            raise

    def _stop(self, request: RefitRequest, why: str) -> None:
        """Stop every rank of this refit at once (the engine will never vote). An abort is per
        refit: posted before this rank's refit began it would be dropped with the last refit's
        keys, so wait (bounded) for it to begin."""
        group = self.endpoint.group
        if group is None:
            return
        deadline = time.monotonic() + min(request.timeout_s, 60.0)
        while group.control.epoch < request.epoch and time.monotonic() < deadline:
            time.sleep(0.01)
        group.control.stop_everyone(f"{BACKEND} trainer rank 0: {why}")

    def shutdown(self) -> None:
        self.endpoint.leave()


def check_features(info: ReshardTrainerInitInfo, spec: Any, src: SideLayout, canary_source: bool = True,
                   canary_draft_source: bool = True) -> tuple[PeftConfig | None, bool]:
    """(the LoRA policy, whether the engine drafts) from ``info``, checked against each other,
    the model and what the trainers hold: one line naming the field, before the engine is called.
    ``canary_source`` / ``canary_draft_source``: whether this rank's endpoint can compute a
    canary's reference, and its MTP draft's."""
    if info.canary and not canary_source:
        raise ConfigError("init_info.canary: this rank's endpoint has no policy to compute the canary's reference "
                          "with (TrainerEndpoint(..., canary=policy.top_logprobs))")
    if info.canary and info.engine_speculative_config and not canary_draft_source:
        raise ConfigError("init_info.canary with engine_speculative_config: the canary checks the engine's draft, and "
                          "this rank's endpoint has no MTP head to compute its reference with "
                          "(TrainerEndpoint(..., canary_draft=policy.draft_top_logprobs))")
    peft = info.peft
    if isinstance(peft, dict):
        try:
            peft = PeftConfig.from_wire(peft)
        except (LayoutError, TypeError) as exc:
            raise ConfigError(f"init_info.peft: {first_error_line(exc)}") from None
    if peft is not None and not isinstance(peft, PeftConfig):
        raise ConfigError(f"init_info.peft: a PeftConfig or its dict, got {type(peft).__name__}")
    peft = peft if peft is not None and peft.enabled else None
    quant = info.engine_quantization
    if quant not in QUANTIZATIONS:
        raise ConfigError(f"init_info.engine_quantization={quant!r} is not one of {list(QUANTIZATIONS)} (vLLM's "
                          f"block-FP8 'fp8_per_block', quantized at the senders; vLLM's 'fp8' is per tensor)")
    if quant is not None and peft is not None:
        raise ConfigError(f"init_info.peft with engine_quantization={quant}: LoRA adapters into an FP8 engine are not "
                          f"supported (vLLM's LoRA layers take unquantized bases here)")
    held = {q.canonical for q in src.pieces()}
    adapters = sorted(n for n in held if is_adapter_tensor(n))
    if adapters and peft is None:
        raise ConfigError(f"init_info.peft: the trainers hold LoRA adapters ({adapters[0]}, ...) but no peft is given "
                          f"(the policy's PeftConfig, as its engine was started with enable_lora)")
    if peft is not None and not adapters:
        raise ConfigError("init_info.peft: given, but the trainers hold no LoRA adapter (build the policy with it)")
    speculative = info.engine_speculative_config
    if not speculative:
        return peft, False
    method = speculative.get("method") if isinstance(speculative, dict) else None
    if method not in ("mtp", "deepseek_mtp"):
        raise ConfigError(f"init_info.engine_speculative_config.method={method!r}: the draft refit knows 'mtp' (or "
                          f"'deepseek_mtp'): the model's own MTP layers")
    if not spec.mtp_layers:
        raise ConfigError(f"init_info.engine_speculative_config: {spec.name} has no MTP layers to draft with")
    if not held & set(draft_tensors(spec)):
        raise ConfigError("init_info.engine_speculative_config: the trainers hold no MTP layer (build the policy "
                          "with megatron's MTP block): the engine's draft would go stale")
    if quant is not None or peft is not None:
        raise ConfigError(f"init_info.engine_speculative_config with {'engine_quantization' if quant else 'peft'}: "
                          f"an MTP draft beside it is not described")
    return peft, True


def _lora_wrapped(side: SideLayout) -> SideLayout:
    """The engine's side as an ``enable_lora`` engine holds it: vLLM's LoRA manager wraps every
    linear and the embedding (``lora/layers``: ``BaseLayerWithLoRA.base_layer``), so their
    weights are ``<module>.base_layer.weight`` (the LM head stays: its logits processor is what
    is wrapped)."""
    def wrapped(name: str) -> str:
        module, _, leaf = name.rpartition(".")
        if module.endswith("_proj") or module.endswith("embed_tokens"):
            return f"{module}.base_layer.{leaf}"
        return name

    return replace(side, params=tuple(replace(p, name=wrapped(p.name), pieces=tuple(
        Piece(q.rank, wrapped(q.local_name), q.canonical, q.box, q.view) for q in p.pieces)) for p in side.params))


def _as_draft(p: LocalParam) -> LocalParam:
    """A draft parameter named as the engine's workers record it (``draft.<name>``)."""
    return replace(p, name="draft." + p.name, pieces=tuple(
        Piece(q.rank, "draft." + q.local_name, q.canonical, q.box, q.view) for q in p.pieces))


class _Call:
    """One call on its own thread; ``wait`` gives its error line (None: it returned)."""

    def __init__(self, fn: Any) -> None:
        self.error: str | None = None

        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - handed to wait()
                self.error = f"{type(exc).__name__}: {first_error_line(exc)}"

        self.thread = threading.Thread(target=run, daemon=True, name="mcore-reshard-engine-call")
        self.thread.start()

    @property
    def done(self) -> bool:
        return not self.thread.is_alive()

    def wait(self, timeout_s: float) -> str | None:
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            return f"no answer within {timeout_s:.0f}s"
        return self.error


def _register() -> None:
    """A training rank runs no vLLM plugin loading: importing this end registers it with vLLM's
    trainer-side factory (as vLLM's own backends are registered when its factory is imported;
    ``plugin.register`` does the same in vLLM's processes, idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    try:
        WeightTransferTrainerFactory.register_engine(BACKEND, ReshardTrainerEngine)
    except ValueError:  # vLLM's answer to a second registration of the name (no public lookup)
        pass


_register()
