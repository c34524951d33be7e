"""Ranks of a DTensor policy (``testing.dtensor.build_dtensor_policy``: NeMo RL's DTensor
backend's shape, FSDP2 + TP), trained with AdamW on gloo, refitting a vLLM ``LLM`` in the test
process through vLLM's trainer API only (``testing.trainer_api``) with
``TrainerShards(DTensorEndpoint(model, spec))``."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from mcore_reshard.testing.dtensor import build_dtensor_policy
from mcore_reshard.testing.worlds import WorldCtx


def dtensor_trainer_api_job(ctx: WorldCtx, ckpt: str, dp: int, tp: int, info: dict, tokens: list, steps: int,
                            saved: str, calls: Any, replies: Any) -> dict:
    """``steps`` times: an AdamW step on ``tokens`` (none before the first refit), then
    ``send_weights``; each rank's reports and pieces; at the end rank 0 writes the trained
    weights (gathered from the shards, for the test's fresh engine only) to ``saved``."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from mcore_reshard.testing.trainer_api import ForwardingClient
    from mcore_reshard.adapters.dtensor import DTensorEndpoint
    from mcore_reshard.adapters.dtensor.source import canonical_name
    from mcore_reshard.adapters.vllm.backend import ReshardTrainerInitInfo, TrainerShards
    from mcore_reshard.errors import RefitFailed
    from mcore_reshard.layout import load_model_spec

    dist.init_process_group("gloo", init_method=f"tcp://{ctx.master_addr}:{ctx.master_port}", rank=ctx.rank,
                            world_size=ctx.world_size)
    spec = load_model_spec(ckpt, dtype="float32")
    model = build_dtensor_policy(ckpt, dp, tp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    endpoint = DTensorEndpoint(model, spec)
    client = ForwardingClient(calls, replies)
    engine = WeightTransferTrainerFactory.trainer_init(ReshardTrainerInitInfo(rank=ctx.rank, **info), client=client,
                                                       source=TrainerShards(endpoint))
    x = torch.tensor([tokens])
    out: dict[str, Any] = {"reports": [], "bytes_min": engine.plans.plan.bytes_min,
                           "pieces": [(p.name, p.pieces[0].box.offsets, p.pieces[0].box.sizes)
                                      for p in endpoint.describe()],
                           "placements": {n: str(tuple(p.placements)) for n, p in model.named_parameters()}}
    for step in range(steps):
        if step:
            opt.zero_grad()
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
        try:
            engine.send_weights()
        except RefitFailed as exc:  # asserted by the test (replicas that drifted apart)
            out.setdefault("failed", {})[step] = str(exc)
        else:
            out["reports"].append(sorted((r.side, r.rank, r.verified, r.bytes_received - r.bytes_headers)
                                         for r in engine.last_reports if r is not None))
        if ctx.rank == 0:
            client.probe(step)
    engine.shutdown()
    full = {canonical_name(n): p.full_tensor().contiguous() for n, p in model.named_parameters()}  # collective
    if ctx.rank == 0:
        Path(saved).mkdir(parents=True)
        shutil.copy(Path(ckpt) / "config.json", Path(saved) / "config.json")
        save_file(full, str(Path(saved) / "model.safetensors"))
    dist.destroy_process_group()
    return out


def refusal_lines(ctx: WorldCtx, ckpt: str) -> list[str]:
    """What ``dtensor_params`` says of layouts it cannot describe: a parameter whose name is
    not HF's, one of another global shape, one with a Partial placement; then what an endpoint
    says of an FSDP2 model read after a forward-only pass, before and after ``reshard()``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    from mcore_reshard.adapters.dtensor import dtensor_params
    from mcore_reshard.layout import LayoutError, load_model_spec

    dist.init_process_group("gloo", init_method=f"tcp://{ctx.master_addr}:{ctx.master_port}", rank=ctx.rank,
                            world_size=ctx.world_size)
    spec = load_model_spec(ckpt, dtype="float32")
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    name = "model.layers.0.mlp.down_proj.weight"
    shape = spec.tensor_table()[name][0]
    local = torch.zeros(shape[0] // ctx.world_size, shape[1])
    cases = [("model.layers.0.mlp.not_hf.weight", DTensor.from_local(local, mesh, [Shard(0)])),
             (name, DTensor.from_local(torch.zeros(shape[0], shape[1] // 2), mesh, [Shard(0)])),
             (name, DTensor.from_local(torch.zeros(shape), mesh, [Partial()]))]
    lines = []
    for fqn, p in cases:
        try:
            dtensor_params([(fqn, p)], spec, ctx.rank)
            lines.append("")
        except LayoutError as exc:
            lines.append(str(exc))
    # FSDP2 leaves the root's parameters whole after a forward-only pass: reading them as the
    # shards they were described as is refused; once resharded they are read
    from mcore_reshard.adapters.dtensor import DTensorEndpoint

    endpoint = DTensorEndpoint(build_dtensor_policy(ckpt, ctx.world_size, 1), spec)
    endpoint.describe()
    with torch.no_grad():
        endpoint.model(input_ids=torch.tensor([[1, 2, 3]]))
    for _ in range(2):
        try:
            endpoint.local_tensors()
            lines.append("")
        except LayoutError as exc:
            lines.append(str(exc))
        endpoint.reshard()
    dist.destroy_process_group()
    return lines
