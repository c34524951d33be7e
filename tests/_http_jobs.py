"""Trainer processes for the HTTP-server test: megatron-core ranks that build a
``TrainerEndpoint``, plan against the vLLM server's rules, publish the engine's plan slices
in the refit group's store (the init info names them by digest only) and hand the controller
(the test process) its JSON messages through a queue: a refit, a second one after training
(which the controller makes fail), a retry in a new refit group, then two faults of their own:
a flipped bit on the wire, the same in a streaming refit, and a killed trainer (rank 1 exits
before its vote). ``http_two_refits_job``: a trained refit, then the server's own checkpoint
refit back (the server's first answers, vLLM's own load of it, are the reference).
``vllm_trainer_api_job``: the trainers reach the server through vLLM's own trainer-side API
only (``WeightTransferTrainerFactory``, ``HTTPVLLMWeightSyncClient``)."""

from __future__ import annotations

import json
import time
from typing import Any

from mcore_reshard.adapters.megatron.build import init_megatron
from mcore_reshard.testing.worlds import WorldCtx
from mcore_reshard.adapters.megatron.endpoint import TrainerEndpoint
from mcore_reshard.adapters.megatron.rules import MegatronParallel
from mcore_reshard.adapters.megatron.train import TrainSettings, build_policy
from mcore_reshard.adapters.vllm.rules import VllmParallel, vllm_layout
from mcore_reshard.infra.checkpoint import load_canonical
from mcore_reshard.errors import RefitError, RefitFailed
from mcore_reshard.layout import SideLayout, load_model_spec
from mcore_reshard.plan import build_plan
from mcore_reshard.plan.wire import slice_to_wire
from mcore_reshard.wire.canary import make_canary
from mcore_reshard.infra.ports import free_port
from mcore_reshard.wire.protocol import JoinInfo, RankMap, RefitRequest, first_error_line
from mcore_reshard.wire.slice_store import publish_slices, slice_digests
from mcore_reshard.wire.faults import Fault


def http_refit_job(ctx: WorldCtx, ckpt: str, dtype: str, par: MegatronParallel, vllm: VllmParallel,
                   tokens: list[int], to_controller: Any) -> dict:
    import torch.distributed as dist

    policy, ep, src, dst, plan = _trained_endpoint(ctx, ckpt, dtype, par, vllm, tokens)
    digest = plan.digest()
    boxed = [free_port() if ctx.rank == 0 else None]
    dist.broadcast_object_list(boxed, src=0)
    rank_map = RankMap.disaggregated(src.world_size, dst.world_size)
    info = JoinInfo("127.0.0.1", boxed[0], rank_map.world_size, rank_map, 120.0, secret="test-secret",
                    nonce="http-test-1")
    dst_slices = {str(r): slice_to_wire(plan.for_rank("dst", r)) for r in range(dst.world_size)}
    first = RefitRequest(digest, timeout_s=120.0, version="refit-1")
    if ctx.rank == 0:  # the controller's message is JSON only: join, plan digest, one digest per slice
        to_controller.put({"init_info": {"join": info.to_wire(), "plan_digest": digest,
                                         "slice_digests": slice_digests(dst_slices)},
                           "update_info": {"request": first.to_wire()}})
    ep.join(info)
    if ctx.rank == 0:  # the store lives with this group: publish after every join
        publish_slices(ep.group.store, dst_slices)
    ep.set_plan(slice_to_wire(plan.for_rank("src", ctx.rank)), digest)
    ep.refit(first)
    logprobs_1 = policy.logprobs([tokens])[0]

    policy.train_step([tokens])  # weights the engine must never serve: the next refit fails
    # The engine refuses this refit before any byte moves; its abort stops the trainers at once
    # (a short timeout all the same, so a regression costs seconds, not minutes).
    second = RefitRequest(digest, timeout_s=30.0, version="refit-2")
    if ctx.rank == 0:
        to_controller.put({"update_info": {"request": second.to_wire()}})
    error, t0 = "", time.monotonic()
    try:
        ep.refit(second)
    except RefitError as exc:
        error = first_error_line(exc)
    second_s = time.monotonic() - t0
    logprobs_2 = policy.logprobs([tokens])[0]

    # The controller's retry after the failed refit: a new group (fresh port and nonce), the
    # slices published in its new store, the same plan.
    third = RefitRequest(digest, timeout_s=120.0, version="refit-3")
    _rejoin(ep, ctx, rank_map, dst_slices, digest, third, "http-test-2", to_controller)
    ep.refit(third)

    # A flipped bit on the wire (rank 0 flips one after its checksum was taken): the engine's
    # checksums catch it, no one commits. Trained weights first, so a torn refit would show.
    policy.train_step([tokens])
    logprobs_3 = policy.logprobs([tokens])[0]
    fourth = RefitRequest(digest, timeout_s=30.0, version="refit-4")
    if ctx.rank == 0:
        to_controller.put({"update_info": {"request": fourth.to_wire()}})
    flip_error = ""
    try:
        ep.refit(fourth, fault=Fault("bitflip", bucket=0) if ctx.rank == 0 else None)
    except RefitError as exc:
        flip_error = first_error_line(exc)

    # A streaming refit (layers go live as they complete) with a flipped bit, in a new group
    # (a failed refit closes its group): it fails after layers went live, a mix in the workers.
    fifth = RefitRequest(digest, timeout_s=30.0, version="refit-5", atomic=False)
    _rejoin(ep, ctx, rank_map, dst_slices, digest, fifth, "http-test-3", to_controller)
    torn_error = ""
    try:
        ep.refit(fifth, fault=Fault("bitflip", bucket=2) if ctx.rank == 0 else None)
    except RefitError as exc:
        torn_error = first_error_line(exc)

    # A killed trainer: rank 1 exits after its last byte, before its vote, in a new group.
    sixth = RefitRequest(digest, timeout_s=30.0, version="refit-6")
    _rejoin(ep, ctx, rank_map, dst_slices, digest, sixth, "http-test-4", to_controller)
    kill_error = ""
    try:
        ep.refit(sixth, fault=Fault("exit", at="before_vote") if ctx.rank == 1 else None)
    except RefitError as exc:
        kill_error = first_error_line(exc)
    ep.leave()
    return {"logprobs_1": logprobs_1, "logprobs_2": logprobs_2, "logprobs_3": logprobs_3, "second_error": error,
            "second_s": second_s, "flip_error": flip_error, "torn_error": torn_error,
            "kill_error": kill_error,
            "init_info_bytes_inline": len(json.dumps(dst_slices))}


def http_two_refits_job(ctx: WorldCtx, ckpt: str, dtype: str, par: MegatronParallel, vllm: VllmParallel,
                        tokens: list[int], to_controller: Any) -> dict:
    """Two refits in one group: the weights after a training step, then ``ckpt`` itself again
    (what the server loaded at start; an overlapped refit), each handed to the controller as
    JSON, each with the canary on (``refit.canary``: the policy's likely tokens after each
    prefix of fixed sequences, the server's workers vote on their own forward over them; the
    first computed before the refit, the second deferred to the trainers inside it)."""
    policy, ep, src, dst, plan = _trained_endpoint(ctx, ckpt, dtype, par, vllm, tokens)
    digest = plan.digest()
    rank_map = RankMap.disaggregated(src.world_size, dst.world_size)
    dst_slices = {str(r): slice_to_wire(plan.for_rank("dst", r)) for r in range(dst.world_size)}
    vocab = policy.spec.vocab
    first = RefitRequest(digest, timeout_s=120.0, version="refit-1",
                         canary=make_canary(vocab, dtype, 2, 8, 0.0, policy.top_logprobs))
    _rejoin(ep, ctx, rank_map, dst_slices, digest, first, "http-two-1", to_controller)
    ep.set_plan(slice_to_wire(plan.for_rank("src", ctx.rank)), digest)
    ep.refit(first)
    reports = [ep.last_reports]
    logprobs_1 = policy.logprobs([tokens])[0]

    policy.load_canonical(load_canonical(ckpt))  # the server's own checkpoint, refit back
    # overlapped: /update_weights returns at once, the workers receive on their own threads,
    # /finish_weight_update swaps
    # its canary deferred: the request carries the sequences only, the trainers compute the
    # reference after their last byte and hand it to the server's workers in the refit group
    ep.canary = policy.top_logprobs
    second = RefitRequest(digest, timeout_s=120.0, version="refit-2", overlap=True,
                          canary=make_canary(vocab, dtype, 2, 8, 0.0))
    if ctx.rank == 0:
        to_controller.put({"update_info": {"request": second.to_wire()}})
    ep.refit(second)
    reports.append(ep.last_reports)
    ep.leave()
    dst_reports = [[r for r in rs if r is not None and r.side == "dst"] for rs in reports]
    received = [sum(r.bytes_received - r.bytes_headers for r in rs) for rs in dst_reports]
    full = [sum(r.bytes_full for r in rs) for rs in dst_reports]
    delta = [all(r.delta.on for r in rs) for rs in dst_reports]
    verified = [sorted((r.side, r.rank) for r in rs if r is not None and r.verified) for rs in reports]
    canary = [[r.phases.get("canary", 0.0) > 0 for r in rs] for rs in dst_reports]
    return {"logprobs_1": logprobs_1, "bytes_min": plan.bytes_min, "received": received, "full": full,
            "delta": delta, "verified": verified, "canary": canary,
            "ranks": sorted([("src", r) for r in range(src.world_size)] + [("dst", r) for r in range(dst.world_size)])}


def _trained_endpoint(ctx: WorldCtx, ckpt: str, dtype: str, par: MegatronParallel, vllm: VllmParallel,
                      tokens: list[int]) -> tuple[Any, TrainerEndpoint, SideLayout, SideLayout, Any]:
    """A megatron policy from ``ckpt`` after one training step, its trainer endpoint, both
    sides' layouts (every rank's descriptors gathered) and the plan into the server's layout."""
    import torch.distributed as dist

    spec = load_model_spec(ckpt, dtype=dtype)
    init_megatron(par, ctx.rank, ctx.world_size, ctx.master_addr, ctx.master_port)
    policy = build_policy(spec, par, TrainSettings(dtype=dtype, lr=0.05))
    policy.load_canonical(load_canonical(ckpt))
    policy.train_step([tokens])
    ep = TrainerEndpoint(policy.chunks, spec, sync_params=policy.sync_params)
    every: list = [None] * ctx.world_size
    dist.all_gather_object(every, ep.describe())
    src = SideLayout("megatron", ctx.world_size, tuple(p for r in every for p in r), spec.tensor_table())
    dst = vllm_layout(spec, vllm)
    return policy, ep, src, dst, build_plan(src, dst, bucket_bytes=1 << 16)


def _rejoin(ep: TrainerEndpoint, ctx: WorldCtx, rank_map: RankMap, dst_slices: dict, digest: str,
            request: RefitRequest, nonce: str, to_controller: Any) -> None:
    """A new refit group (fresh port and nonce): hand the controller its init info and the
    request, join, publish the engine's slices in the new store."""
    import torch.distributed as dist

    boxed = [free_port() if ctx.rank == 0 else None]
    dist.broadcast_object_list(boxed, src=0)
    info = JoinInfo("127.0.0.1", boxed[0], rank_map.world_size, rank_map, 120.0, secret="test-secret", nonce=nonce)
    if ctx.rank == 0:
        to_controller.put({"init_info": {"join": info.to_wire(), "plan_digest": digest,
                                         "slice_digests": slice_digests(dst_slices)},
                           "update_info": {"request": request.to_wire()}})
    ep.join(info)
    if ctx.rank == 0:
        publish_slices(ep.group.store, dst_slices)


def vllm_trainer_api_job(ctx: WorldCtx, ckpt: str, dtype: str, par: MegatronParallel, vllm: VllmParallel,
                         tokens: list[int], url: str) -> dict:
    """Two training steps, each sent with ``send_weights`` through vLLM's trainer-side API and
    nothing else of this project's refit calls; rank 0 reads what the server then serves."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from mcore_reshard.refit.servers import prompt_logprobs
    from mcore_reshard.adapters.vllm.backend import ReshardTrainerInitInfo, TrainerShards

    spec = load_model_spec(ckpt, dtype=dtype)
    init_megatron(par, ctx.rank, ctx.world_size, ctx.master_addr, ctx.master_port)
    policy = build_policy(spec, par, TrainSettings(dtype=dtype, lr=0.05))
    policy.load_canonical(load_canonical(ckpt))
    source = TrainerShards(TrainerEndpoint(policy.chunks, spec, sync_params=policy.sync_params))
    client = HTTPVLLMWeightSyncClient(url, timeout=300)

    class Flaky(HTTPVLLMWeightSyncClient):
        """vLLM's HTTP client whose next ``update_weights`` fails before it is sent."""

        drop_next_update = False

        def update_weights(self, update_info: Any) -> None:
            if self.drop_next_update:
                self.drop_next_update = False
                raise ConnectionError("injected: the connection to the server dropped")
            super().update_weights(update_info)

    flaky = Flaky(url, timeout=300)
    out: dict[str, Any] = {"trainer": [], "served": [], "reports": []}
    # A layout stated wrongly (the engine holds fp32, not bf16): the engine refuses its slice, and
    # the first refit fails on every rank in one line, before a byte moves.
    wrong = WeightTransferTrainerFactory.trainer_init(
        ReshardTrainerInitInfo(rank=ctx.rank, engine_tp=vllm.tp, engine_dtype="bfloat16", allow_cast=True,
                               timeout_s=120.0), client=client, source=source)
    t0 = time.monotonic()
    try:
        wrong.send_weights()
    except RefitFailed as exc:
        out["refused"] = (str(exc), time.monotonic() - t0)
    if ctx.rank == 0:  # what the server serves after the refused refit
        out["after_refused"] = prompt_logprobs(url, ckpt, tokens)
    wrong.shutdown()
    engine = WeightTransferTrainerFactory.trainer_init(
        ReshardTrainerInitInfo(rank=ctx.rank, engine_tp=vllm.tp, timeout_s=120.0), client=flaky, source=source)
    # The connection drops on rank 0's first update_weights: every rank fails at once, the
    # engine's session is closed, and the next send_weights builds a new refit group first.
    flaky.drop_next_update = True
    t0 = time.monotonic()
    try:
        engine.send_weights()
    except RefitFailed as exc:
        out["dropped"] = (str(exc), time.monotonic() - t0)
    if ctx.rank == 0:  # and after the refit whose update_weights never reached it
        out["after_dropped"] = prompt_logprobs(url, ckpt, tokens)
    for _ in range(2):
        policy.train_step([tokens])
        engine.send_weights()
        out["trainer"].append(policy.logprobs([tokens])[0])
        out["reports"].append(sorted((r.side, r.rank, r.verified, r.bytes_received - r.bytes_headers, r.bytes_full,
                                      r.delta.on) for r in source.endpoint.last_reports if r is not None))
        if ctx.rank == 0:
            out["served"].append(prompt_logprobs(url, ckpt, tokens))
    out["bytes_min"] = engine.plan.bytes_min
    out["refit"] = source.endpoint.last_outcome.refit  # the last refit's identity
    engine.shutdown()
    return out
