"""The trainer behind Celery and the command line: a real ``trajstore worker --queues train``
process on the embedded Redis trains from ``train_step`` tasks and keeps its model between
them; ``trajstore train`` runs the loop in the foreground."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import trainer_episodes
from trainer_episodes import new_run, record_group

from store.leasing import Leasing
from store.settings import Settings
from tests.workers import conftest as worker_fixtures
from workers.engines.backend_transformers import TransformersBackend

tiny_model = trainer_episodes.tiny_model
trainer_settings = trainer_episodes.trainer_settings
trainer_store = trainer_episodes.trainer_store
worker_db = worker_fixtures.worker_db
broker_url = worker_fixtures.broker_url
worker_settings = worker_fixtures.worker_settings
worker_store = worker_fixtures.worker_store
start_worker = worker_fixtures.start_worker

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(400)
def test_train_worker_trains_from_tasks_and_keeps_its_model(
        worker_store, start_worker, tiny_model: Path) -> None:
    from workers.app import app

    run_id = new_run(worker_store, tiny_model, group_size=2, max_negatives=0)
    engine = TransformersBackend(tiny_model)
    for seed in (1, 2):
        record_group(worker_store, engine, run_id, size=2, seed=seed, max_tokens=4)
    worker = start_worker("--queues", "train")  # prefork, concurrency 1: the default
    worker.wait_ready()
    leasing = Leasing(worker_store)
    config = {"lr": 1e-3, "groups_per_step": 1, "betas": [0.9, 0.99]}
    for version in (1, 2):
        app.send_task("trajstore.train_step", args=[run_id, config], queue="train")
        # The acknowledgement is the step's last act.
        worker_fixtures.wait_for(lambda v=version: leasing.stats(run_id)["consumed"] == 2 * v,
                                 timeout=240, what=f"the samples of step {version}")
    assert leasing.current_policy_version(run_id) == 2
    assert leasing.stats(run_id)["ready"] == 0
    log = worker.log_path.read_text()
    assert log.count(f"opened the trainer of run {run_id}") == 1, log[-3000:]
    # Nothing ready: the task trains nothing and the worker stays up.
    app.send_task("trajstore.train_step", args=[run_id, config], queue="train")
    worker_fixtures.wait_for(
        lambda: worker.log_path.read_text().count("] succeeded in") == 3,
        timeout=120, what="the empty step")
    assert "'version': None" in worker.log_path.read_text()
    assert leasing.current_policy_version(run_id) == 2
    assert worker.proc.poll() is None


def run_cli(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
    env.update({"TRAJSTORE_DATABASE_URL": settings.database_url or "",
                "TRAJSTORE_DATA_DIR": str(settings.data_dir), "COLUMNS": "200"})
    return subprocess.run([sys.executable, "-m", "trajstore", "train", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300, check=False)


def test_train_command_runs_steps_in_the_foreground(
        trainer_store, trainer_settings: Settings, tiny_model: Path) -> None:
    run_id = new_run(trainer_store, tiny_model, group_size=2, max_negatives=0)
    engine = TransformersBackend(tiny_model)
    for seed in (1, 2):
        record_group(trainer_store, engine, run_id, size=2, seed=seed, max_tokens=4)
    done = run_cli(trainer_settings, "--run", run_id, "--steps", "3", "--groups", "1",
                   "--lr", "1e-3")
    assert done.returncode == 0, done.stderr
    assert "trained 2 step(s); policy version 2" in done.stdout
    assert "stopped after 2 of 3 steps" in done.stdout
    assert Leasing(trainer_store).current_policy_version(run_id) == 2

    missing = run_cli(trainer_settings, "--run", "no-such-run")
    assert missing.returncode == 1 and "no run 'no-such-run'" in missing.stdout
    bad = run_cli(trainer_settings, "--run", run_id, "--estimator", "ppo")
    assert bad.returncode == 2 and "advantage_estimator" in bad.stderr
