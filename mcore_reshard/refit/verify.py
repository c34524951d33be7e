"""Proving a refit wrote the right weights, beyond the transport's own checksums.

* ``token_mult_prob_error``: NeMo RL's check, mean(exp(|gen logprob - train logprob|)) over the
  same tokens; 1.0 when both sides compute the same model (NeMo RL treats < 1.05 as healthy).
* ``full_verification``: gather canonical tensors from the trainers' local weights and compare
  every destination element each worker holds (live parameter where the kernel keeps model
  format, else the copy the engine kept while receiving with ``verify=full``).
"""

from __future__ import annotations

from typing import Any, Sequence

from ..errors import RefitError
from ..layout import SideLayout
from ..wire.protocol import token_mult_prob_error

__all__ = ["token_mult_prob_error", "full_verification"]


def full_verification(src: SideLayout, dst: SideLayout, trainer_locals: Sequence[dict[str, Any]],
                      engines: Sequence[Any]) -> str:
    """Compare every destination piece with the gathered canonical tensors; raises
    ``RefitError`` naming the parameter and destination rank of the first mismatch."""
    import torch

    from ..adapters.vllm.engine import received_weights
    from ..transport.views import box_slices, gather_canonical, local_view

    canonical = gather_canonical(src.params, src.tensors, trainer_locals)
    scale = dict(dst.scale)
    by_rank: dict[int, list] = {}
    for p in dst.params:
        by_rank.setdefault(p.rank, []).append(p)
    compared = {"live": 0, "received": 0}
    rank = 0
    for llm in engines:
        for held in received_weights(llm):
            for p in by_rank.get(rank, []):
                tensor, where = held.tensors[p.name], held.where[p.name]
                for q in p.pieces:
                    want = canonical[q.canonical][box_slices(q.box)].to(tensor.dtype)
                    if q.canonical in scale:  # held times alpha / r, rounded as the sender rounds it
                        want = want.clone().mul_(scale[q.canonical])
                    if not torch.equal(local_view(tensor.contiguous(), q.view), want):
                        raise RefitError(f"full verification: {p.name} on destination rank {rank} ({where}) differs "
                                         f"from training's {q.canonical} at box {q.box}")
                    compared[where] += q.numel
            rank += 1
    return (f"full verification: {compared['live']} live and {compared['received']} received elements equal "
            f"the gathered canonical tensors")
