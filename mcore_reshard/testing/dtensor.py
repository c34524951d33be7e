"""A DTensor policy built as NeMo RL's DTensor backend builds one (tests and benchmarks): an HF
model, tensor-parallel through ``parallelize_module`` on the mesh's "tp" dimension, then FSDP2
(``fully_shard``) over its "dp" dimension."""

from __future__ import annotations

from typing import Any

__all__ = ["TP_PLAN", "build_dtensor_policy"]

#: NeMo RL's tensor-parallel plan of a Qwen/Llama decoder layer (``parallelize_module``).
TP_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
           "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
           "mlp.down_proj": "rowwise"}


def build_dtensor_policy(ckpt: str, dp: int, tp: int) -> Any:
    """The HF model of ``ckpt`` (fp32), TP over "tp", FSDP2 over "dp" (every decoder layer, then
    the root), on the default process group's ranks."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import AutoModelForCausalLM

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    if tp > 1:
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tp"], {k: styles[v]() for k, v in TP_PLAN.items()})
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model
