"""GRPO's math, as NeMo RL's ``grpo_train`` and ``ClippedPGLossFn`` compute it: the task's
reward and group-normalised advantages; the clipped-ratio loss with an optional KL penalty to a
frozen reference is ``losses.clipped_pg_loss`` (re-exported here). Pure functions, no processes.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Sequence

from ...training.losses import GrpoBatch, clipped_pg_loss  # re-exported: the loss lives below the training ranks

__all__ = ["TargetTokensTask", "ColourSquaresTask", "GrpoBatch", "group_advantages", "clipped_pg_loss", "completion_logprobs",
           "token_versions", "trajectory_age"]


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

    def score(self, step: int, prompt: int, completion: Sequence[int]) -> float:
        """The reward of ``completion`` of prompt ``prompt`` of step ``step`` (the loop's form)."""
        return self.reward(completion)


#: The colours of :class:`ColourSquaresTask`, in class order (``infra.vlm.COLOURS`` draws them).
SQUARE_COLOURS = ("red", "green", "blue")


@dataclass(frozen=True)
class ColourSquaresTask:
    """A verifiable task with images that a tiny random vision-language model can learn on CPU:
    each prompt is the same ``prompt_length`` random text ids (drawn once per run) with one
    image placeholder after the first; its image is a light ``image_size`` square with one coloured square on it (red,
    green or blue, anywhere, covering from three quarters of its side to all of it). The reward is the
    fraction of generated ids ``t`` with ``t % 3`` the colour's class: a policy that ignores
    the image scores about 1/3, one that reads the colour off it scores 1. The text says
    nothing of the colour. Seeded per step: a run is reproducible."""

    vocab: int
    prompt_length: int
    image_token: int
    image_size: int
    seed: int = 0

    def _rng(self, step: int) -> random.Random:
        return random.Random(self.seed * 1_000_003 + step)

    def _draw(self, step: int, n: int) -> list[tuple[list[int], int, tuple[int, int, int]]]:
        rng, size, out = self._rng(step), self.image_size, []
        fixed = random.Random(self.seed)  # one text for every prompt: only the image tells them apart
        text = [fixed.randrange(self.vocab) for _ in range(self.prompt_length)]
        text = [t if t != self.image_token else (t + 1) % self.vocab for t in text]
        for _ in range(n):
            colour = rng.randrange(len(SQUARE_COLOURS))
            side = rng.randrange(max(1, 3 * size // 4), size + 1)
            out.append((text[:1] + [self.image_token] + text[1:], colour,
                        (rng.randrange(size - side + 1), rng.randrange(size - side + 1), side)))
        return out

    def prompts(self, step: int, n: int) -> list[list[int]]:
        """Token ids with one image placeholder (vLLM's processor expands it per patch)."""
        return [p for p, _, _ in self._draw(step, n)]

    def images(self, step: int, n: int) -> list:
        """Each prompt's image (PIL), as the engines take it."""
        from ...infra.vlm import colour_squares

        return [colour_squares(self.image_size, [(SQUARE_COLOURS[c], x, y, side)])
                for _, c, (x, y, side) in self._draw(step, n)]

    def score(self, step: int, prompt: int, completion: Sequence[int]) -> float:
        colour = self._draw(step, prompt + 1)[prompt][1]
        return sum(t % len(SQUARE_COLOURS) == colour for t in completion) / max(1, len(completion))

    @property
    def random_policy_reward(self) -> float:
        return 1 / len(SQUARE_COLOURS)


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


def completion_logprobs(logprobs: Sequence[float], prompt_length: int) -> list[float]:
    """The completion's part of a sequence's ``[T-1]`` next-token logprobs."""
    return list(logprobs[prompt_length - 1:])


def token_versions(spans: Sequence[tuple[str, int, int]], n_tokens: int) -> list[int]:
    """The policy version that produced each of a completion's ``n_tokens`` tokens, from vLLM's
    ``weight_versions`` spans ``(version, start, end)`` (the GRPO run names each refit's
    version by its policy version: "0", "1", ...). Spans must cover every token once."""
    out: list[int | None] = [None] * n_tokens
    for version, start, end in spans:
        try:
            v = int(version)
        except ValueError:
            raise ValueError(f"weight version {version!r} is not a policy version (an engine this run did not "
                             f"refit?)") from None
        if not 0 <= start <= end <= n_tokens or any(x is not None for x in out[start:end]):
            raise ValueError(f"weight-version span {version!r} [{start}, {end}) overlaps another or leaves the "
                             f"{n_tokens} tokens")
        out[start:end] = [v] * (end - start)
    if any(x is None for x in out):
        raise ValueError(f"weight-version spans {list(spans)} do not cover all {n_tokens} tokens")
    return out  # type: ignore[return-value]


def trajectory_age(policy_version: int, versions: Sequence[Sequence[int]]) -> int:
    """How many policy versions old a batch is when ``policy_version`` trains on it: measured
    from its oldest token (a sample that spans a refit is as old as its first token)."""
    return policy_version - min(min(v) for v in versions if v)
