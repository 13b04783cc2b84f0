"""A real ``trajstore worker --queues rollout,replay`` process reports the policy versions its
engine takes: the base weights with its first group, then, after a training step, the version
the step recorded, loaded from the checkpoint ``policy_updated`` names, with its lag."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from store.eventlog import EventStore
from store.serving import policy_takeup
from store.settings import Settings
from tests.rollout.test_group_worker import new_run, projected, send
from tests.workers.conftest import (  # noqa: F401  (fixtures)
    broker_url,
    start_worker,
    wait_for,
    worker_db,
    worker_settings,
    worker_store,
)
from workers.engines.tinymodel import tiny_model_path
from workers.trainer.config import TrainerConfig
from workers.trainer.loop import Trainer


def took(store: EventStore, run_id: str, version: int) -> list[Any]:
    return [e for v in policy_takeup(store, run_id, version=version) for e in v.engines]


@pytest.mark.timeout(600)
def test_worker_reports_each_version_its_engine_takes(
        worker_store: EventStore, worker_settings: Settings,  # noqa: F811
        start_worker: Callable[..., Any]) -> None:  # noqa: F811
    run_id = new_run(worker_store, worker_settings, group_size=2)
    worker = start_worker("--queues", "rollout,replay")
    worker.wait_ready()
    send(run_id, "arith-0-1")
    wait_for(lambda: projected(worker_store, run_id) == 2, 300, "the first group replayed")
    (base,) = took(worker_store, run_id, 0)
    # The worker's own engine: its host and process, not this test's.
    assert base.backend == "TransformersBackend" and base.lag_seconds is None
    assert f":{os.getpid()}/" not in base.engine and base.source is None

    trainer = Trainer.open(worker_store, run_id,
                           model=str(tiny_model_path(worker_settings.data_dir / "models")),
                           config=TrainerConfig(lr=1e-3, groups_per_step=1),
                           data_dir=worker_settings.data_dir / "trainer")
    step = trainer.step()
    assert step.version == 1 and not took(worker_store, run_id, 1)
    send(run_id, "arith-0-2")
    wait_for(lambda: took(worker_store, run_id, 1), 300, "the worker to take version 1")
    (engine,) = took(worker_store, run_id, 1)
    assert engine.engine == base.engine and engine.source == str(step.checkpoint)
    assert engine.lag_seconds is not None and engine.lag_seconds > 0
    assert engine.load_seconds is not None and engine.load_seconds > 0
    # The episodes of the second group ran on version 1.
    wait_for(lambda: projected(worker_store, run_id) == 4, 300, "the second group replayed")
    calls = [getattr(r, "event", r) for e in worker_store.list_episodes(run_id)
             for r in worker_store.get_episode(e.episode_id) if r.type == "llm_called"]
    assert {c.policy_version for c in calls} == {0, 1}
