"""``NegativeConfig.baseline``: whether a negative sample moves its GRPO group's statistics
(``group``, seed ``000``) or takes its own reward as its advantage (``episodes``), for GRPO
and EGPO, sample and rollout level; the trainer reads the rule from the run; a bad value is
refused at run creation naming the field."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest
import torch
import trainer_episodes
from trainer_episodes import new_run

from store.eventlog import NO_STREAM, run_stream_id
from store.events import NegativeConfig, RunConfig, RunCreated
from workers.trainer.advantages import ADVANTAGE_ESTIMATORS, AdvantageSettings, batch_advantages
from workers.trainer.config import TrainerConfig
from workers.trainer.loop import Trainer

tiny_model = trainer_episodes.tiny_model
trainer_settings = trainer_episodes.trainer_settings
trainer_store = trainer_episodes.trainer_store

GRPO = ADVANTAGE_ESTIMATORS.get("grpo")
EGPO = ADVANTAGE_ESTIMATORS.get("egpo")
EPISODES = AdvantageSettings(negatives_in_baseline=False, cot_start_id=7, cot_end_id=8)
GROUP = AdvantageSettings(cot_start_id=7, cot_end_id=8)


def _rows(scores: list[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rewards = torch.zeros((len(scores), 3))
    rewards[:, -1] = torch.tensor(scores)
    mask = torch.ones_like(rewards)
    responses = torch.tensor([[7, 5, 8]] * len(scores))  # <think> x </think>
    return rewards, mask, responses


def _advantages(estimator, scores, index, negative, settings, units=None):
    rewards, mask, responses = _rows(scores)
    entropies = torch.full(rewards.shape, 0.5)
    return batch_advantages(estimator, rewards, mask, index, torch.tensor(negative),
                            entropies=entropies, responses=responses, settings=settings,
                            units=units)


def test_a_group_whose_episodes_all_failed_trains_only_its_negative() -> None:
    scores, index = [0.0, 0.0, 0.0, -2.0], ["g"] * 4
    negative = [False, False, False, True]
    inside = _advantages(GRPO, scores, index, negative, GROUP)
    # group: the negative drags the mean below 0, so the three failed episodes are lifted.
    assert all(v > 0.4 for v in inside[:3, 0].tolist())
    outside = _advantages(GRPO, scores, index, negative, EPISODES)
    assert outside[:3].abs().max().item() == 0.0
    assert outside[3].tolist() == [-2.0, -2.0, -2.0]


@pytest.mark.parametrize("estimator", [GRPO, EGPO], ids=["grpo", "egpo"])
def test_episodes_get_the_advantages_of_their_group_without_negatives(estimator) -> None:
    scores = [1.0, 0.0, 0.0, -1.0, 1.0, 1.0, 0.0, -1.0, -1.0]
    index = ["a", "a", "a", "a", "b", "b", "b", "b", "b"]
    negative = [False, False, False, True, False, False, False, True, True]
    got = _advantages(estimator, scores, index, negative, EPISODES)
    kept = [i for i, n in enumerate(negative) if not n]
    alone = _advantages(estimator, [scores[i] for i in kept], [index[i] for i in kept],
                        [False] * len(kept), GROUP)
    assert torch.equal(got[kept], alone)
    assert got[[3, 7, 8]].tolist() == [[-1.0] * 3] * 3
    # group: the same episodes' advantages differ once the negatives join.
    assert not torch.equal(_advantages(estimator, scores, index, negative, GROUP)[kept], alone)


def test_rollout_level_units_follow_their_rows() -> None:
    scores = [1.0, 1.0, 0.0, -1.0]
    index, units = ["g"] * 4, ["e1", "e1", "e2", "negative:9"]
    got = _advantages(GRPO, scores, index, [False, False, False, True], EPISODES, units)
    # Two episodes, 1 and 0: +-0.7071 over units, the negative its reward.
    assert got[:, 0].tolist() == pytest.approx([0.70710564, 0.70710564, -0.70710564, -1.0],
                                               rel=1e-5)


def test_negative_rows_keep_their_mask() -> None:
    rewards, mask, responses = _rows([1.0, 0.0, -1.0])
    mask[2, 0] = 0.0  # padding before the negative's response
    got = batch_advantages(GRPO, rewards, mask, ["g"] * 3, torch.tensor([False, False, True]),
                           entropies=torch.zeros_like(rewards), responses=responses,
                           settings=EPISODES)
    assert got[2].tolist() == [0.0, -1.0, -1.0]


def test_without_negatives_both_rules_agree() -> None:
    scores, index = [1.0, 0.0, 0.0, 1.0], ["g"] * 4
    assert torch.equal(_advantages(EGPO, scores, index, [False] * 4, EPISODES),
                       _advantages(EGPO, scores, index, [False] * 4, GROUP))


def test_a_malformed_negative_flag_is_refused() -> None:
    rewards, mask, responses = _rows([1.0, -1.0])
    with pytest.raises(ValueError, match="is_negative must be a bool tensor of shape"):
        batch_advantages(GRPO, rewards, mask, ["g"] * 2, torch.tensor([1, 1, 0]),
                         entropies=torch.zeros_like(rewards), responses=responses,
                         settings=EPISODES)


def test_a_bad_baseline_is_refused_naming_the_field() -> None:
    with pytest.raises(pydantic.ValidationError, match="baseline"):
        RunConfig(negatives={"baseline": "batch"})
    assert NegativeConfig().baseline == "group"


@pytest.mark.parametrize("baseline", ["group", "episodes"])
def test_the_trainer_takes_the_rule_from_the_run(trainer_store, tiny_model: Path,
                                                 baseline: str) -> None:
    run_id = new_run(trainer_store, tiny_model)
    if baseline == "episodes":
        run_id = "run-episodes-baseline"
        config = RunConfig(model=str(tiny_model), tokenizer=str(tiny_model),
                           negatives=NegativeConfig(baseline="episodes"))
        trainer_store.append(run_stream_id(run_id), [RunCreated(run_id=run_id, config=config)],
                             NO_STREAM)
    trainer = Trainer.open(trainer_store, run_id, config=TrainerConfig(lr=1e-3))
    assert trainer.advantage_settings.negatives_in_baseline is (baseline == "group")
