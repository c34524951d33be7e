"""A DTensor policy that trains: NeMo RL's DTensor backend's shape (an HF model, TP through
``parallelize_module`` on the mesh's "tp" dimension, then FSDP2's ``fully_shard`` over "dp"),
with the calls the jobs' training ranks answer (``training.pool.DTensorTrainerRank``).

Every rank runs the whole batch: TP needs the same inputs on its ranks, and FSDP2's gradient
reduce-scatter averages the data-parallel ranks' identical gradients, so a step is the batch's
mean loss however the mesh is cut (the data-parallel ranks compute the same forward: on this
project's tiny CPU models that costs less than splitting and gathering a batch of a few rows).
Log-probabilities are fp32 log-softmax over the full vocab, as vLLM computes them.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ...infra.optim import learning_rate
from ...layout import ModelSpec
from .parallel import TP_PLAN, DTensorParallel

__all__ = ["build_dtensor_model", "DTensorPolicy"]

#: ``loss_fn(logprobs, index)``: as ``adapters.megatron.train.LossFn``.
LossFn = Callable[[torch.Tensor, int], torch.Tensor]


def build_dtensor_model(ckpt: str, par: DTensorParallel) -> Any:
    """The HF model of ``ckpt`` (fp32), TP over "tp", FSDP2 over "dp" (every decoder layer, then
    the root), on the default process group's ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import AutoModelForCausalLM

    mesh = init_device_mesh("cpu", (par.dp, par.tp), mesh_dim_names=("dp", "tp"))
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    model.eval()  # no dropout: the logprobs a step trains on are the ones the engine computes
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    if par.tp > 1:
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tp"], {k: styles[v]() for k, v in TP_PLAN.items()})
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def _clip_grads(params: list[torch.Tensor], max_norm: float) -> None:
    """Clip the gradients' global norm to ``max_norm``. torch's ``clip_grad_norm_`` stacks every
    gradient's norm, which DTensors on different meshes refuse (TP's 2-D mesh beside FSDP2's
    1-D one): each mesh's norm is reduced over its own mesh, then they combine."""
    from torch.distributed.tensor import DTensor

    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p.grad)
    squares = torch.zeros(())
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        squares = squares + (norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2
    scale = torch.clamp(max_norm / (squares.sqrt() + 1e-6), max=1.0)
    for grads in by_mesh.values():  # each mesh's gradients scaled by the one factor
        torch._foreach_mul_([g.to_local() if isinstance(g, DTensor) else g for g in grads], scale)


class DTensorPolicy:
    """A DTensor policy on this rank: the model, torch's AdamW over its DTensor parameters."""

    def __init__(self, spec: ModelSpec, par: DTensorParallel, checkpoint: str, *, lr: float = 1e-3,
                 weight_decay: float = 0.0, clip_grad: float = 1.0, seed: int = 1234) -> None:
        torch.manual_seed(seed)
        self.spec, self.par, self.clip_grad = spec, par, clip_grad
        self.model = build_dtensor_model(checkpoint, par)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay)

    def local_params(self) -> dict[str, torch.Tensor]:
        """Every parameter's local shard (its storage), by the model's own name."""
        from .source import _local

        return {n: _local(p) for n, p in self.model.named_parameters()}

    def _target_logprobs(self, seq: Sequence[int]) -> torch.Tensor:
        """log p(seq[i] | seq[:i]) for i >= 1 (fp32)."""
        x = torch.tensor([list(seq)])
        logits = self.model(input_ids=x).logits[0, :-1].float()
        return torch.log_softmax(logits, dim=-1).gather(1, x[0, 1:, None])[:, 0]

    def logprobs(self, token_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        with torch.no_grad():
            return [self._target_logprobs(seq).tolist() for seq in token_ids]

    def top_logprobs(self, token_ids: Sequence[Sequence[int]]) -> list[tuple[list[int], list[float]]]:
        """Per sequence: the most likely next token after each prefix and its log-prob."""
        out = []
        with torch.no_grad():
            for seq in token_ids:
                logits = self.model(input_ids=torch.tensor([list(seq)])).logits[0, :-1].float()
                best, token = torch.log_softmax(logits, dim=-1).max(dim=-1)
                out.append(([int(t) for t in token], best.tolist()))
        return out

    def train_step(self, token_ids: Sequence[Sequence[int]], loss_fn: LossFn | None = None,
                   lr: float | None = None) -> float:
        """One AdamW step on the batch's mean loss (default: next-token cross-entropy averaged
        over positions), gradients clipped to ``clip_grad`` (0: none); ``lr``: this step's."""
        self.optimizer.zero_grad()
        losses = []
        for i, seq in enumerate(token_ids):
            lp = self._target_logprobs(seq)
            losses.append(-lp.mean() if loss_fn is None else loss_fn(lp, i))
        loss = torch.stack(losses).mean()
        loss.backward()
        if self.clip_grad:
            _clip_grads(list(self.model.parameters()), self.clip_grad)
        with learning_rate(self.optimizer, lr):
            self.optimizer.step()
        return float(loss.detach())
