"""Policy losses a training rank computes: NeMo RL's clipped-ratio GRPO loss.

Below both the training ranks (``trainer.py``, which runs it inside megatron's schedule) and
the GRPO job (``jobs/grpo/``, which builds the batch), so neither imports the other. Pure math;
torch only where a gradient flows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["GrpoBatch", "PgLossSettings", "clipped_pg_loss"]


@dataclass(frozen=True)
class GrpoBatch:
    """What the trainers need per sequence besides its tokens (index = sequence index)."""

    advantages: tuple[float, ...]
    prev_logprobs: tuple[tuple[float, ...], ...]  # policy logprobs before the step, per target position
    reference_logprobs: tuple[tuple[float, ...], ...] | None  # frozen reference (KL), or None
    prompt_length: int  # targets before prompt_length - 1 are prompt tokens: masked out


class PgLossSettings(Protocol):
    """The clipping and KL settings the loss reads (the recipe's ``loss_fn``: ``LossSettings``)."""

    reference_policy_kl_penalty: float
    ratio_clip_min: float
    ratio_clip_max: float


def clipped_pg_loss(lp: Any, batch: GrpoBatch, index: int, loss: PgLossSettings) -> Any:
    """NeMo RL's ``ClippedPGLossFn`` for one sequence, averaged over its completion tokens:
    ``-min(r * A, clip(r, 1 - eps_lo, 1 + eps_hi) * A)`` with ``r = exp(lp - prev_lp)``, plus
    ``reference_policy_kl_penalty`` times the k3 estimator of KL(pi || pi_ref)
    (``exp(ref - lp) - (ref - lp) - 1``). ``lp``: the sequence's ``[T-1]`` target logprobs
    (with gradient)."""
    import torch

    k = batch.prompt_length - 1
    cur = lp[k:]
    prev = torch.tensor(batch.prev_logprobs[index][k:], dtype=cur.dtype)
    adv = float(batch.advantages[index])
    ratio = torch.exp(cur - prev)
    clipped = torch.clamp(ratio, 1.0 - loss.ratio_clip_min, 1.0 + loss.ratio_clip_max)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    if loss.reference_policy_kl_penalty > 0 and batch.reference_logprobs is not None:
        ref = torch.tensor(batch.reference_logprobs[index][k:], dtype=cur.dtype)
        d = ref - cur
        per_token = per_token + loss.reference_policy_kl_penalty * (torch.exp(d) - d - 1.0)
    return per_token.mean()
