"""Megatron-core ranks that refit a vLLM ``LLM`` through vLLM's trainer-side API only
(``WeightTransferTrainerFactory.trainer_init`` + ``send_weights``), the engine living in the
test process: rank 0's weight-sync client forwards each of vLLM's calls to that ``LLM``'s own
methods (``init_weight_transfer_engine``, ``start_weight_update``, ...), and asks the test
process to read what the engine serves after each refit (``probe``)."""

from __future__ import annotations

from typing import Any

from mcore_reshard.adapters.megatron.build import init_megatron
from mcore_reshard.adapters.megatron.endpoint import TrainerEndpoint
from mcore_reshard.adapters.megatron.rules import MegatronParallel
from mcore_reshard.adapters.megatron.train import TrainSettings, build_policy
from mcore_reshard.infra.checkpoint import load_canonical
from mcore_reshard.layout import load_model_spec
from mcore_reshard.testing.trainer_api import ForwardingClient
from mcore_reshard.testing.worlds import WorldCtx


def trainer_api_job(ctx: WorldCtx, ckpt: str, dtype: str, par: MegatronParallel, info: dict, tokens: list,
                    steps: int, calls: Any, replies: Any, build: dict) -> dict:
    """``steps`` times: a training step (none before the first refit when ``steps`` counts it
    as 0), then ``send_weights``; every rank's reports and the trainer's logprobs of
    ``tokens[0]`` after each."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from mcore_reshard.adapters.vllm.backend import ReshardTrainerInitInfo, TrainerShards
    from mcore_reshard.layout.lora import PeftConfig

    spec = load_model_spec(ckpt, dtype=dtype)
    init_megatron(par, ctx.rank, ctx.world_size, ctx.master_addr, ctx.master_port)
    peft = PeftConfig.from_wire(info["peft"]) if info.get("peft") else None
    policy = build_policy(spec, par, TrainSettings(dtype=dtype, lr=build.get("lr", 0.05)), peft=peft,
                          mtp=build.get("mtp", False))
    policy.load_canonical(load_canonical(ckpt))
    source = TrainerShards(TrainerEndpoint(policy.chunks, spec, sync_params=policy.sync_params,
                                           canary=policy.top_logprobs, canary_draft=policy.draft_top_logprobs))
    client = ForwardingClient(calls, replies)
    engine = WeightTransferTrainerFactory.trainer_init(ReshardTrainerInitInfo(rank=ctx.rank, **info), client=client,
                                                       source=source)
    out: dict[str, Any] = {"plans": [], "reports": [], "trainer": [],
                           "bytes_min": engine.plans.plan.bytes_min,
                           "adapter_bytes_min": engine.plans.adapter_plan.bytes_min if engine.plans.adapter_plan else 0,
                           "planned": sorted({t.canonical for t in engine.plans.plan.transfers})}
    for step in range(steps):
        if step or build.get("train_first"):
            for _ in range(build.get("train_steps", 1)):
                policy.train_step(tokens)
        out["plans"].append(engine.plan.bytes_min)
        engine.send_weights()
        out["reports"].append(sorted((r.side, r.rank, r.verified, r.bytes_received - r.bytes_headers, r.bytes_full,
                                      r.delta.on, r.phases.get("canary", 0.0) > 0)
                                     for r in engine.last_reports if r is not None))
        out["trainer"].append(policy.logprobs(tokens[:1])[0])
        if ctx.rank == 0:
            client.probe(step)
    engine.shutdown()
    if build.get("save"):  # the trained weights as an HF checkpoint: what a fresh engine loads to compare
        _save_trained(policy, spec, ckpt, build["save"], ctx.rank)
    return out


def _save_trained(policy: Any, spec: Any, like: str, out: str, rank: int) -> None:
    """Every rank's pieces of ``policy`` assembled into the canonical tensors (in the policy's
    dtype) on rank 0, written beside ``like``'s config."""
    import shutil
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    from mcore_reshard.infra.checkpoint import checkpoint_form
    from mcore_reshard.transport.views import local_view

    policy.sync_params()
    mine = (policy.describe(), {n: t.detach().cpu() for n, t in policy.local_params().items()})
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if rank:
        return
    dtype = next(iter(mine[1].values())).dtype
    canon = {n: torch.empty(shape, dtype=dtype) for n, (shape, _) in spec.tensor_table().items()}
    for params, local in every:
        for p in params:
            for pc in p.pieces:
                box = tuple(slice(o, o + n) for o, n in zip(pc.box.offsets, pc.box.sizes))
                canon[pc.canonical][box] = local_view(local[p.name], pc.view)
    Path(out).mkdir()
    for f in Path(like).glob("*.json"):
        shutil.copy(f, Path(out) / f.name)
    save_file({n: t.contiguous() for n, t in checkpoint_form(canon, spec).items()}, str(Path(out) / "model.safetensors"))
