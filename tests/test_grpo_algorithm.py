"""GRPO's math against hand-computed values: rewards, group advantages, the clipped loss."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from mcore_reshard.jobs.grpo.algorithm import GrpoBatch, TargetTokensTask, clipped_pg_loss, group_advantages

LOSS = SimpleNamespace(reference_policy_kl_penalty=0.0, ratio_clip_min=0.2, ratio_clip_max=0.2)


def test_task_rewards_and_seeded_prompts():
    task = TargetTokensTask.from_fraction(1000, 0.125, prompt_length=5, seed=3)
    assert task.target_ids == 125 and task.random_policy_reward == 0.125
    assert task.reward([0, 124, 125, 999]) == 0.5
    assert task.prompts(7, 2) == task.prompts(7, 2) != task.prompts(8, 2)
    assert all(len(p) == 5 and all(0 <= t < 1000 for t in p) for p in task.prompts(0, 4))


def test_group_advantages_normalised_per_group():
    adv = group_advantages([1.0, 0.0, 0.5, 0.5], 2)
    std = math.sqrt(0.5)  # sample std of (1, 0)
    assert adv[:2] == pytest.approx([0.5 / std, -0.5 / std], rel=1e-5)
    assert adv[2:] == [0.0, 0.0]  # equal rewards teach nothing
    assert group_advantages([1.0, 0.0, 0.0], 3, normalize=False, leave_one_out=True) == pytest.approx([1.0, -0.5, -0.5])
    with pytest.raises(ValueError):
        group_advantages([1.0, 0.0, 1.0], 2)


def _batch(adv: float, prev: list[float], ref=None) -> GrpoBatch:
    return GrpoBatch((adv,), (tuple(prev),), None if ref is None else (tuple(ref),), prompt_length=2)


def test_clipped_loss_on_policy_is_minus_advantage_and_pushes_the_logprobs():
    # lp covers targets 1..3 of a 4-token sequence; prompt_length 2 -> the last 2 are the completion.
    lp = torch.tensor([-5.0, -1.0, -2.0], requires_grad=True)
    loss = clipped_pg_loss(lp, _batch(2.0, [-5.0, -1.0, -2.0]), 0, LOSS)
    assert float(loss) == pytest.approx(-2.0)
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([0.0, -1.0, -1.0])  # the prompt target is masked out


def test_clipped_loss_clips_the_ratio():
    # ratio e^{0.5} = 1.65 > 1.2 with a positive advantage: the clipped term wins, no gradient.
    lp = torch.tensor([0.0, -0.5, -0.5], requires_grad=True)
    loss = clipped_pg_loss(lp, _batch(1.0, [0.0, -1.0, -1.0]), 0, LOSS)
    assert float(loss) == pytest.approx(-1.2)
    loss.backward()
    assert lp.grad.abs().sum() == 0


def test_kl_penalty_is_the_k3_estimator():
    kl = SimpleNamespace(reference_policy_kl_penalty=0.5, ratio_clip_min=0.2, ratio_clip_max=0.2)
    lp = torch.tensor([0.0, -1.0, -1.0])
    d = 0.3  # reference logprob - policy logprob on both completion tokens
    loss = clipped_pg_loss(lp, _batch(0.0, [0.0, -1.0, -1.0], ref=[0.0, -1.0 + d, -1.0 + d]), 0, kl)
    assert float(loss) == pytest.approx(0.5 * (math.exp(d) - d - 1.0), rel=1e-6)
