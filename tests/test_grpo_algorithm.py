"""GRPO's math against hand-computed values: rewards, group advantages, the clipped loss."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from mcore_reshard.jobs.grpo.algorithm import (GrpoBatch, TargetTokensTask, clipped_pg_loss, group_advantages,
                                               token_versions, trajectory_age)

LOSS = SimpleNamespace(reference_policy_kl_penalty=0.0, ratio_clip_min=0.2, ratio_clip_max=0.2,
                       use_importance_sampling_correction=False, truncated_importance_sampling_ratio=None)


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
    kl = SimpleNamespace(**{**vars(LOSS), "reference_policy_kl_penalty": 0.5})
    lp = torch.tensor([0.0, -1.0, -1.0])
    d = 0.3  # reference logprob - policy logprob on both completion tokens
    loss = clipped_pg_loss(lp, _batch(0.0, [0.0, -1.0, -1.0], ref=[0.0, -1.0 + d, -1.0 + d]), 0, kl)
    assert float(loss) == pytest.approx(0.5 * (math.exp(d) - d - 1.0), rel=1e-6)


def test_importance_sampling_weights_each_token_by_prev_over_generation():
    """pi_prev / mu per token, no gradient through it: equal logprobs change nothing; a token
    the engine sampled at half the trainer's probability counts twice; a non-finite weight 0."""
    from dataclasses import replace

    IS = SimpleNamespace(**{**vars(LOSS), "use_importance_sampling_correction": True})
    prev = [0.0, -1.0, -2.0]
    lp = torch.tensor(prev, requires_grad=True)
    plain = clipped_pg_loss(lp, _batch(1.0, prev), 0, LOSS)
    same = replace(_batch(1.0, prev), generation_logprobs=((-1.0, -2.0),))
    assert clipped_pg_loss(lp, same, 0, IS).item() == pytest.approx(plain.item())
    half = replace(_batch(1.0, prev), generation_logprobs=((-1.0 - math.log(2.0), -2.0),))
    # on-policy per-token loss is -A = -1 for both tokens; weights (2, 1) -> mean -1.5
    loss = clipped_pg_loss(lp, half, 0, IS)
    assert loss.item() == pytest.approx(-1.5)
    loss.backward()
    assert lp.grad[1].item() == pytest.approx(-1.0) and lp.grad[2].item() == pytest.approx(-0.5)
    capped = SimpleNamespace(**{**vars(IS), "truncated_importance_sampling_ratio": 1.5})
    assert clipped_pg_loss(torch.tensor(prev), half, 0, capped).item() == pytest.approx(-1.25)  # weights (1.5, 1)
    inf = replace(_batch(1.0, prev), generation_logprobs=((-math.inf, -2.0),))
    assert clipped_pg_loss(torch.tensor(prev), inf, 0, IS).item() == pytest.approx(-0.5)
    with pytest.raises(ValueError, match="no generation logprobs"):
        clipped_pg_loss(lp, _batch(1.0, prev), 0, IS)
    with pytest.raises(ValueError, match="3 generation logprobs for 2"):
        clipped_pg_loss(lp, replace(_batch(1.0, prev), generation_logprobs=((0.0, 0.0, 0.0),)), 0, IS)


def test_token_versions_from_weight_version_spans_and_trajectory_age():
    assert token_versions([("3", 0, 5), ("4", 5, 8)], 8) == [3] * 5 + [4] * 3
    assert token_versions([("7", 0, 4)], 4) == [7] * 4
    for spans, n, msg in ([("3", 0, 5)], 8, "do not cover"), ([("3", 0, 5), ("4", 4, 8)], 8, "overlaps"), \
                         ([("3", 0, 9)], 8, "leaves"), ([("default", 0, 8)], 8, "not a policy version"):
        with pytest.raises(ValueError, match=msg):
            token_versions(spans, n)
    # a batch is as old as its oldest token, a spanning sample as its first token
    assert trajectory_age(5, [[4, 4, 5], [5, 5, 5]]) == 1
    assert trajectory_age(5, [[5, 5], [5]]) == 0
    assert trajectory_age(6, [[3, 4], [5]]) == 3
