"""Each sample is scored at the temperature it was sampled at: at zero staleness every
importance ratio is 1 for a run sampled at 0.7 (real tiny model, real recorded episodes), also
when one batch mixes episodes sampled at different temperatures (greedy ones included); an
explicit trainer temperature overrides that, visibly."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import trainer_episodes
from trainer_episodes import new_run, record_group

from store.eventlog import run_stream_id
from store.events import PolicyUpdated, RunConfig
from store.leasing import Lease
from store.queries import episode_sampling_params
from workers.engines.backend_transformers import TransformersBackend
from workers.trainer.config import TrainerConfig
from workers.trainer.loop import StepHooks, Trainer
from workers.trainer.ppo import score_batch
from workers.trainer.temperature import (
    recorded_temperature,
    scoring_temperature,
    scoring_temperatures,
)

tiny_model = trainer_episodes.tiny_model
trainer_settings = trainer_episodes.trainer_settings
trainer_store = trainer_episodes.trainer_store


def _ratios_at_lease(trainer: Trainer) -> tuple[list[torch.Tensor], list[tuple[float, ...]]]:
    """A step whose hook records, before the update, each token's importance ratio
    ``exp(old - rollout)`` (the trainer's scoring of the leased batch against the engine's
    log-probs) and the rows' scoring temperatures; the step then trains as usual."""
    seen: list[torch.Tensor] = []
    temps: list[tuple[float, ...]] = []

    def inspect(lease: Lease) -> None:
        batch, _ = trainer._pad(lease)
        old, _ = score_batch(trainer.model, batch, config=trainer.config)
        valid = batch.response_mask > 0
        seen.append(torch.exp(old - batch.rollout_log_probs)[valid])
        temps.append(tuple(batch.temperatures.tolist()))

    result = trainer.step(hooks=StepHooks(after_lease=inspect))
    assert result.trained
    return seen, temps


def test_zero_staleness_ratios_are_one_for_a_run_sampled_at_0_7(
        trainer_store: Any, tiny_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    run_id = new_run(trainer_store, tiny_model, group_size=4, temperature=0.7)
    engine = TransformersBackend(tiny_model)
    for seed in (1, 2):
        record_group(trainer_store, engine, run_id, size=4, seed=seed, temperature=0.7)
    trainer = Trainer.open(trainer_store, run_id, config=TrainerConfig(
        lr=1e-3, groups_per_step=1, micro_batch_size=4))
    ratios, temps = _ratios_at_lease(trainer)
    assert temps == [(0.7,) * 4]
    assert ratios[0].numel() > 8
    assert float((ratios[0] - 1).abs().max()) < 1e-4  # every token's ratio is 1

    # An explicit trainer temperature wins, is logged, and (here, wrongly) moves the ratios.
    with caplog.at_level(logging.WARNING, logger="workers.trainer.loop"):
        forced = Trainer.open(trainer_store, run_id, config=TrainerConfig(
            lr=1e-3, groups_per_step=1, micro_batch_size=4, temperature=1.0))
    assert any("TrainerConfig.temperature=1.0" in r.getMessage() and run_id in r.getMessage()
               for r in caplog.records)
    ratios, temps = _ratios_at_lease(forced)
    assert temps == [(1.0,) * 4]
    assert float((ratios[0] - 1).abs().max()) > 0.05
    step = trainer_store.read_stream(run_stream_id(run_id))[-1].event
    assert isinstance(step, PolicyUpdated)
    assert step.metrics["scoring_temperature_override"] == 1.0


def test_each_episode_is_scored_at_its_own_temperature(trainer_store: Any,
                                                       tiny_model: Path) -> None:
    """The run samples at 1.0 by default, but these episodes recorded 0.7, 1.3 and greedy
    (0: scored unscaled): one batch, every ratio 1."""
    run_id = new_run(trainer_store, tiny_model, group_size=2)
    engine = TransformersBackend(tiny_model)
    for seed, temperature in ((1, 0.7), (2, 1.3), (3, 0.0)):
        record_group(trainer_store, engine, run_id, size=2, seed=seed, temperature=temperature)
    trainer = Trainer.open(trainer_store, run_id, config=TrainerConfig(
        lr=1e-3, groups_per_step=3, micro_batch_size=3))
    ratios, temps = _ratios_at_lease(trainer)
    assert sorted(set(temps[0])) == [0.7, 1.0, 1.3]
    assert float((ratios[0] - 1).abs().max()) < 1e-4
    step = trainer_store.read_stream(run_stream_id(run_id))[-1].event
    assert isinstance(step, PolicyUpdated)
    assert step.metrics["scoring_temperature_min"] == 0.7
    assert step.metrics["scoring_temperature_max"] == 1.3
    assert step.metrics["scoring_temperature_override"] == 0.0
    assert step.metrics["scoring_temperature_unrecorded"] == 0.0
    assert step.metrics["correction_clipped_frac"] == 0.0


def test_recorded_sampling_params_are_read_in_one_query(trainer_store: Any,
                                                        tiny_model: Path) -> None:
    run_id = new_run(trainer_store, tiny_model, group_size=2)
    engine = TransformersBackend(tiny_model)
    record_group(trainer_store, engine, run_id, size=2, seed=4, temperature=0.9)
    episodes = [e.episode_id for e in trainer_store.list_episodes(run_id)]
    found = episode_sampling_params(trainer_store, [*episodes, "not-an-episode", run_id])
    assert set(found) == set(episodes)
    assert all(params["temperature"] == 0.9 for params in found.values())
    assert episode_sampling_params(trainer_store, []) == {}


def test_scoring_temperatures_order_and_bad_values() -> None:
    run = RunConfig(rollout={"temperature": 0.6})
    recorded = {"a": {"temperature": 0.8}, "b": {}, "c": {"temperature": "hot"},
                "d": {"temperature": True}, "e": {"temperature": -1}, "f": {"temperature": 0}}
    temps, metrics = scoring_temperatures(list("abcdefg"), recorded, run)
    # a: recorded; b-e and g (no record): the run's 0.6; f: greedy, scored at 1.
    assert temps == (0.8, 0.6, 0.6, 0.6, 0.6, 1.0, 0.6)
    assert metrics == {"scoring_temperature_override": 0.0,
                       "scoring_temperature_unrecorded": 5.0,
                       "scoring_temperature_min": 0.6, "scoring_temperature_max": 1.0}
    forced, metrics = scoring_temperatures(list("ab"), recorded, run, override=1.2)
    assert forced == (1.2, 1.2) and metrics["scoring_temperature_override"] == 1.0
    greedy_run, _ = scoring_temperatures(["x"], {}, RunConfig(rollout={"temperature": 0.0}))
    assert greedy_run == (1.0,)
    assert recorded_temperature(None) is None and recorded_temperature({"temperature": 2}) == 2.0
    for bad in (0.0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="override"):
            scoring_temperatures(["a"], recorded, run, override=bad)
    with pytest.raises(ValueError, match="sampling temperature"):
        scoring_temperature(-0.5)
