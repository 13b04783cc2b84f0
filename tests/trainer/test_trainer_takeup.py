"""Rollout engines report the policy version they serve, and the trainer records when each took
it: after real training steps on the tiny model, an engine attached to the trainer (weights
pushed) and a rollout worker's engine loading the checkpoint named by ``policy_updated``
(``RolloutEngine.ensure`` reporting through the worker's log) each land a ``policy_served``
with the right version, engine id and source; the next step's metrics carry the take-up."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import trainer_episodes
from trainer_episodes import new_run, record_group

from store import errors
from store.serving import policy_takeup
from workers.engines.backend_transformers import TransformersBackend
from workers.engines.identity import engine_id
from workers.rollout.group_log import StoreGroupLog
from workers.rollout.worker_engine import RolloutEngine
from workers.trainer.config import TrainerConfig
from workers.trainer.loop import Trainer

tiny_model = trainer_episodes.tiny_model
trainer_settings = trainer_episodes.trainer_settings
trainer_store = trainer_episodes.trainer_store


def test_engines_report_the_version_they_serve(trainer_store, tiny_model: Path) -> None:
    run_id = new_run(trainer_store, tiny_model, group_size=2)
    pushed = TransformersBackend(tiny_model)
    for seed in (1, 2):
        record_group(trainer_store, pushed, run_id, size=2, seed=seed)
    trainer = Trainer.open(trainer_store, run_id, engine=pushed,
                           config=TrainerConfig(lr=1e-3, groups_per_step=1))
    # A rollout worker's engine elsewhere, reporting through its log.
    log = StoreGroupLog(trainer_store)
    worker = RolloutEngine(TransformersBackend(tiny_model), kind="transformers",
                           model_dir=tiny_model)
    worker.ensure(run_id, log.policy(run_id), report=log.policy_served)

    first = trainer.step()
    assert first.version == 1
    policy = log.policy(run_id)
    assert policy.version == 1 and policy.checkpoint == str(first.checkpoint)
    worker.ensure(run_id, policy, report=log.policy_served)
    worker.ensure(run_id, policy, report=log.policy_served)  # held already: no new report
    assert worker.backend.policy_version == 1 and worker.loads == 1

    versions = {v.version: v for v in policy_takeup(trainer_store, run_id)}
    assert sorted(versions) == [0, 1]
    # Two backends of one class in one process: two engines, told apart.
    here = f"{socket.gethostname()}:{os.getpid()}/TransformersBackend"
    assert engine_id(pushed).startswith(here) and worker.engine_id.startswith(here)
    assert engine_id(pushed) != worker.engine_id == engine_id(worker.backend)
    assert [(e.engine, e.source) for e in versions[0].engines] == [(worker.engine_id, None)]
    took = {e.source: e for e in versions[1].engines}
    assert set(took) == {"push", str(first.checkpoint)}
    assert took["push"].engine == engine_id(pushed)
    assert took[str(first.checkpoint)].engine == worker.engine_id
    assert {e.backend for e in took.values()} == {"TransformersBackend"}
    for engine in took.values():
        assert engine.lag_seconds is not None and engine.lag_seconds >= 0
        assert engine.load_seconds is not None and engine.load_seconds >= 0
    assert versions[1].step == first.step

    # The next step reports how the engines took the version it started from.
    record_group(trainer_store, pushed, run_id, size=2, seed=3)
    second = trainer.step()
    assert second.version == 2
    assert second.metrics["takeup_engines"] == 2.0
    assert second.metrics["takeup_lag_max_s"] == pytest.approx(
        versions[1].lag_max_seconds, abs=1e-6)
    assert first.metrics["takeup_engines"] == 1.0  # version 0: the worker's base weights
    assert "takeup_lag_max_s" not in first.metrics


def test_a_failed_report_is_made_again_without_reloading(trainer_store,
                                                         tiny_model: Path) -> None:
    run_id = new_run(trainer_store, tiny_model, group_size=2)
    log = StoreGroupLog(trainer_store)
    engine = RolloutEngine(TransformersBackend(tiny_model), kind="transformers",
                           model_dir=tiny_model)
    calls = []

    def refused(*args, **kwargs) -> None:
        calls.append(kwargs["version"])
        raise errors.TransientError("database unreachable")

    with pytest.raises(errors.TransientError):
        engine.ensure(run_id, log.policy(run_id), report=refused)
    assert policy_takeup(trainer_store, run_id) == []
    engine.ensure(run_id, log.policy(run_id), report=log.policy_served)
    assert calls == [0] and engine.loads == 0
    assert [v.version for v in policy_takeup(trainer_store, run_id)] == [0]
    # A version the run never recorded is refused by the log, naming it.
    with pytest.raises(errors.ValidationError, match="has no policy version 3"):
        log.policy_served(run_id, version=3, engine=engine.engine_id, backend="X")
