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
    #: The engine's logprobs of each completion token (the behaviour policy, per sequence), for
    #: ``use_importance_sampling_correction``; None: not sent.
    generation_logprobs: tuple[tuple[float, ...], ...] | None = None


class PgLossSettings(Protocol):
    """The clipping and KL settings the loss reads (the recipe's ``loss_fn``: ``LossSettings``)."""

    reference_policy_kl_penalty: float
    ratio_clip_min: float
    ratio_clip_max: float
    use_importance_sampling_correction: bool
    truncated_importance_sampling_ratio: float | None


def clipped_pg_loss(lp: Any, batch: GrpoBatch, index: int, loss: PgLossSettings) -> Any:
    """NeMo RL's ``ClippedPGLossFn`` for one sequence, averaged over its completion tokens:
    ``-min(r * A, clip(r, 1 - eps_lo, 1 + eps_hi) * A)`` with ``r = exp(lp - prev_lp)``, plus
    ``reference_policy_kl_penalty`` times the k3 estimator of KL(pi || pi_ref)
    (``exp(ref - lp) - (ref - lp) - 1``). ``lp``: the sequence's ``[T-1]`` target logprobs
    (with gradient).

    ``use_importance_sampling_correction`` (asynchronous GRPO: the tokens were sampled by an
    older version, the behaviour policy mu): each token's loss is weighted by
    ``exp(prev_lp - gen_lp)`` = pi_prev / mu, as NeMo RL's loss does (no gradient through it;
    a non-finite weight counts 0), so the mean estimates the loss under pi_prev; capped at
    ``truncated_importance_sampling_ratio`` when set (truncated IS: bias for bounded variance)."""
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
    if loss.use_importance_sampling_correction:
        if batch.generation_logprobs is None:
            raise ValueError("loss_fn.use_importance_sampling_correction=true but the batch has no generation logprobs")
        gen = torch.tensor(batch.generation_logprobs[index], dtype=cur.dtype)
        if gen.shape != prev.shape:
            raise ValueError(f"sequence {index}: {gen.numel()} generation logprobs for {prev.numel()} completion tokens")
        weight = torch.nan_to_num(torch.exp(prev - gen), nan=0.0, posinf=0.0, neginf=0.0)
        if loss.truncated_importance_sampling_ratio is not None:
            weight = torch.clamp(weight, max=loss.truncated_importance_sampling_ratio)
        per_token = weight * per_token
    return per_token.mean()
