"""Rollout-level advantages: GRPO/EGPO statistics over episodes (each counted once, negatives
their own unit), compared with a plain loop; equal to sample level when every episode has one
sample; and the per-sample loss weights that give each episode equal weight."""

from __future__ import annotations

import random

import pytest
import torch
from trainer_loop_reference import loop_rollout_grpo_scalars

from workers.trainer.egpo import egpo_advantages, grpo_advantages, grpo_scalar_advantages
from workers.trainer.loop import unit_ids, unit_loss_weights


def _batch(seed: int) -> tuple[torch.Tensor, list[str], list[str]]:
    rng = random.Random(seed)
    index, units, scores = [], [], []
    for g in range(rng.randint(1, 5)):
        for e in range(rng.randint(1, 5)):
            reward = rng.choice([0.0, 1.0, 0.5, rng.random()])
            for _ in range(rng.randint(1, 4)):  # an episode yields one or more samples
                index.append(f"g{g}")
                units.append(f"g{g}:e{e}")
                scores.append(reward)
        for n in range(rng.randint(0, 2)):  # negatives: each its own unit
            index.append(f"g{g}")
            units.append(f"g{g}:neg{n}")
            scores.append(-1.0)
    order = list(range(len(index)))
    rng.shuffle(order)
    rewards = torch.zeros((len(order), 3))
    rewards[:, -1] = torch.tensor([scores[i] for i in order])
    return rewards, [index[i] for i in order], [units[i] for i in order]


@pytest.mark.parametrize("seed", range(25))
@pytest.mark.parametrize("norm", [True, False])
def test_rollout_level_equals_loop_reference(seed: int, norm: bool) -> None:
    rewards, index, units = _batch(seed)
    got = grpo_scalar_advantages(rewards, index, norm_adv_by_std=norm, units=units)
    expected = loop_rollout_grpo_scalars(rewards.sum(dim=1).tolist(), index, units,
                                         norm_adv_by_std=norm, epsilon=1e-6)
    torch.testing.assert_close(got, torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_an_episode_with_many_samples_counts_once() -> None:
    # Episode a (reward 1) yielded three samples, episode b (reward 0) one.
    rewards = torch.tensor([[1.0], [1.0], [1.0], [0.0]])
    index = ["g"] * 4
    episode = grpo_scalar_advantages(rewards, index, units=["a", "a", "a", "b"])
    sample = grpo_scalar_advantages(rewards, index)
    # Over two episodes: mean 0.5, std sqrt(0.5): +-0.7071 each.
    assert episode.tolist() == pytest.approx([0.70710564] * 3 + [-0.70710564], rel=1e-5)
    # Over four samples the single failure would dominate (mean 0.75).
    assert sample[3] < -1.4


@pytest.mark.parametrize("seed", range(10))
def test_one_sample_per_episode_is_sample_level(seed: int) -> None:
    rewards, index, _ = _batch(seed)
    units = [f"u{i}" for i in range(len(index))]
    mask = torch.ones_like(rewards)
    assert torch.equal(grpo_advantages(rewards, mask, index, units=units)[0],
                       grpo_advantages(rewards, mask, index)[0])
    entropies = torch.rand(rewards.shape, generator=torch.Generator().manual_seed(seed))
    responses = torch.tensor([[7, 5, 8]] * len(index))  # <think>=7 x </think>=8
    kwargs = dict(cot_start_id=7, cot_end_id=8, lam=0.4, alpha=2.0)
    assert torch.equal(
        egpo_advantages(rewards, mask, index, entropies, responses, units=units, **kwargs)[0],
        egpo_advantages(rewards, mask, index, entropies, responses, **kwargs)[0])
    weights = unit_loss_weights(units)
    assert torch.equal(weights, torch.ones(len(units)))


def test_unit_ids_and_loss_weights() -> None:
    units = unit_ids(episode_ids=("e1", "e1", "e2", "e1"), sample_ids=(1, 2, 3, 4),
                     is_negative=(False, False, False, True))
    assert units == ("e1", "e1", "e2", "negative:4")
    assert unit_loss_weights(units).tolist() == [0.5, 0.5, 1.0, 1.0]


def test_a_unit_across_groups_is_refused() -> None:
    with pytest.raises(ValueError, match="units"):
        grpo_scalar_advantages(torch.ones((2, 1)), ["g1", "g2"], units=["e", "e"])
