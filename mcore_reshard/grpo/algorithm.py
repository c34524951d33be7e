"""GRPO's math, as NeMo RL's ``grpo_train`` and ``ClippedPGLossFn`` compute it: the task's
reward, group-normalised advantages and the clipped-ratio loss with an optional KL penalty to
a frozen reference. Pure functions (torch only where a gradient flows), no processes.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["TargetTokensTask", "GrpoBatch", "group_advantages", "clipped_pg_loss", "completion_logprobs"]


@dataclass(frozen=True)
class TargetTokensTask:
    """A verifiable task a tiny random model can learn on CPU: the reward is the fraction of
    generated tokens whose id is below ``target_ids`` (a random policy scores about
    ``target_ids / vocab``; a policy that learned the task scores 1). Prompts are random ids,
    seeded per step, so a run is reproducible."""

    vocab: int
    target_ids: int  # ids 0 .. target_ids-1 are rewarded
    prompt_length: int
    seed: int = 0

    @classmethod
    def from_fraction(cls, vocab: int, fraction: float, prompt_length: int, seed: int = 0) -> "TargetTokensTask":
        return cls(vocab, max(1, round(vocab * fraction)), prompt_length, seed)

    def prompts(self, step: int, n: int) -> list[list[int]]:
        rng = random.Random(self.seed * 1_000_003 + step)
        return [[rng.randrange(self.vocab) for _ in range(self.prompt_length)] for _ in range(n)]

    def reward(self, completion: Sequence[int]) -> float:
        return sum(t < self.target_ids for t in completion) / max(1, len(completion))

    @property
    def random_policy_reward(self) -> float:
        return self.target_ids / self.vocab


def group_advantages(rewards: Sequence[float], group: int, *, normalize: bool = True,
                     leave_one_out: bool = False, eps: float = 1e-6) -> list[float]:
    """Per completion, its reward minus its group's baseline (the group mean, or the mean of
    the others with ``leave_one_out``), divided by the group's std when ``normalize``
    (NeMo RL's ``calculate_baseline_and_std_per_prompt``; a group whose rewards are all equal
    teaches nothing and gets zeros)."""
    if group < 2 or len(rewards) % group:
        raise ValueError(f"{len(rewards)} rewards do not form groups of {group} (>= 2)")
    out: list[float] = []
    for g in range(0, len(rewards), group):
        rs = list(rewards[g:g + group])
        mean = sum(rs) / group
        std = math.sqrt(sum((r - mean) ** 2 for r in rs) / (group - 1))
        for r in rs:
            base = (sum(rs) - r) / (group - 1) if leave_one_out else mean
            adv = r - base
            out.append(adv / (std + eps) if normalize and std > eps else (adv if std > eps else 0.0))
    return out


@dataclass(frozen=True)
class GrpoBatch:
    """What the trainers need per sequence besides its tokens (index = sequence index)."""

    advantages: tuple[float, ...]
    prev_logprobs: tuple[tuple[float, ...], ...]  # policy logprobs before the step, per target position
    reference_logprobs: tuple[tuple[float, ...], ...] | None  # frozen reference (KL), or None
    prompt_length: int  # targets before prompt_length - 1 are prompt tokens: masked out


def completion_logprobs(logprobs: Sequence[float], prompt_length: int) -> list[float]:
    """The completion's part of a sequence's ``[T-1]`` next-token logprobs."""
    return list(logprobs[prompt_length - 1:])


def clipped_pg_loss(lp: Any, batch: GrpoBatch, index: int, loss: Any) -> Any:
    """NeMo RL's ``ClippedPGLossFn`` for one sequence, averaged over its completion tokens:
    ``-min(r * A, clip(r, 1 - eps_lo, 1 + eps_hi) * A)`` with ``r = exp(lp - prev_lp)``, plus
    ``reference_policy_kl_penalty`` times the k3 estimator of KL(pi || pi_ref)
    (``exp(ref - lp) - (ref - lp) - 1``). ``lp``: the sequence's ``[T-1]`` target logprobs
    (with gradient); ``loss``: a ``LossSettings``."""
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
