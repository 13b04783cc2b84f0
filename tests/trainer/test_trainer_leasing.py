"""Trainers sharing a run through the store's leases: real trainer processes in parallel, a
trainer SIGKILLed while it holds a lease, and stale groups skipped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import trainer_episodes
from trainer_episodes import new_run, record_group

from store.eventlog import run_stream_id
from store.events import PolicyUpdated
from store.leasing import Leasing
from store.settings import Settings
from workers.engines.backend_transformers import TransformersBackend
from workers.trainer.config import TrainerConfig
from workers.trainer.loop import Trainer

tiny_model = trainer_episodes.tiny_model
trainer_settings = trainer_episodes.trainer_settings
trainer_store = trainer_episodes.trainer_store

ROOT = Path(__file__).resolve().parents[2]

# A trainer process: opens the store and the run, says "ready", waits for the go file, then
# trains until nothing is ready, printing the sample ids of each step as one JSON line. With
# "hold" it instead stops right after its first lease and sleeps (to be killed there).
TRAINER_PROCESS = r"""
import json, sys, time
from pathlib import Path
import torch
torch.set_num_threads(1)
from store.db import Database
from store.eventlog import EventStore
from store.settings import Settings
from workers.trainer.config import TrainerConfig
from workers.trainer.loop import StepHooks, Trainer

args = json.loads(sys.argv[1])
settings = Settings(database_url=args["url"], data_dir=args["data_dir"])
store = EventStore(Database(args["url"], max_size=2), settings)
config = TrainerConfig(lr=1e-3, groups_per_step=1, lease_seconds=args["lease_seconds"])
trainer = Trainer.open(store, args["run_id"], config=config, name=args["name"])
print("ready", flush=True)
while not Path(args["go"]).exists():
    time.sleep(0.05)

def hold(lease):
    print(json.dumps({"held": [s.sample_id for s in lease.samples]}), flush=True)
    time.sleep(600)

hooks = StepHooks(after_lease=hold) if args["hold"] else None
while (result := trainer.step(hooks=hooks)).trained:
    print(json.dumps({"version": result.version, "samples": list(result.sample_ids)}),
          flush=True)
print("done", flush=True)
"""


def start_trainer(settings: Settings, run_id: str, go: Path, *, name: str, hold: bool = False,
                  lease_seconds: float = 600.0) -> subprocess.Popen[str]:
    args = {"url": settings.database_url, "data_dir": str(settings.data_dir), "run_id": run_id,
            "go": str(go), "name": name, "hold": hold, "lease_seconds": lease_seconds}
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
    return subprocess.Popen([sys.executable, "-c", TRAINER_PROCESS, json.dumps(args)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)


def read_line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"trainer process exited with {proc.wait()}"
    return line.strip()


def all_sample_ids(store: Any, run_id: str) -> set[int]:
    with store.db.connection() as conn:
        return {row[0] for row in conn.execute(
            "SELECT sample_id FROM samples WHERE run_id = %s AND kind = 'positive'",
            (run_id,))}


def test_parallel_trainer_processes_never_share_a_sample(
        trainer_store, trainer_settings: Settings, tiny_model: Path, tmp_path: Path) -> None:
    run_id = new_run(trainer_store, tiny_model, group_size=2, max_negatives=0)
    engine = TransformersBackend(tiny_model)
    for seed in range(8):
        record_group(trainer_store, engine, run_id, size=2, seed=seed, max_tokens=4)
    go = tmp_path / "go"
    procs = [start_trainer(trainer_settings, run_id, go, name=f"t{i}") for i in range(2)]
    try:
        for proc in procs:
            assert read_line(proc) == "ready"
        go.touch()
        steps: list[list[dict[str, Any]]] = []
        for proc in procs:
            out, _ = proc.communicate(timeout=300)
            assert proc.returncode == 0
            lines = out.strip().splitlines()
            assert lines[-1] == "done"
            steps.append([json.loads(line) for line in lines[:-1]])
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    trained = [sample for per_process in steps for step in per_process
               for sample in step["samples"]]
    assert len(trained) == len(set(trained))  # no sample trained twice
    assert set(trained) == all_sample_ids(trainer_store, run_id)
    stats = Leasing(trainer_store).stats(run_id)
    assert (stats["ready"], stats["leased"], stats["consumed"]) == (0, 0, 16)
    # Every step recorded its own policy version, whichever process made it.
    versions = sorted(step["version"] for per_process in steps for step in per_process)
    assert versions == list(range(1, 9))
    recorded = [r.event.version for r in trainer_store.read_stream(run_stream_id(run_id))
                if isinstance(r.event, PolicyUpdated)]
    assert sorted(recorded) == versions


def test_lease_of_a_killed_trainer_expires_and_is_trained_once(
        trainer_store, trainer_settings: Settings, tiny_model: Path, tmp_path: Path) -> None:
    run_id = new_run(trainer_store, tiny_model, group_size=2, max_negatives=0)
    engine = TransformersBackend(tiny_model)
    record_group(trainer_store, engine, run_id, size=2, seed=1, max_tokens=4)
    go = tmp_path / "go"
    go.touch()
    proc = start_trainer(trainer_settings, run_id, go, name="doomed", hold=True,
                         lease_seconds=2.0)
    try:
        assert read_line(proc) == "ready"
        held = json.loads(read_line(proc))["held"]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    leasing = Leasing(trainer_store)
    assert sorted(held) == sorted(all_sample_ids(trainer_store, run_id))
    survivor = Trainer.open(trainer_store, run_id, config=TrainerConfig(lr=1e-3))
    results = survivor.train(1, wait_s=120, poll_s=0.2)  # trains once the lease expired
    assert len(results) == 1
    assert sorted(results[0].sample_ids) == sorted(held)
    assert results[0].version == 1
    assert leasing.stats(run_id)["consumed"] == len(held)
    assert not survivor.step().trained  # trained exactly once
    with trainer_store.db.connection() as conn:
        ended = dict(conn.execute(
            "SELECT trainer, ended FROM leases WHERE run_id = %s", (run_id,)).fetchall())
    assert ended == {"doomed": "expired", survivor.name: "acked"}


def test_stale_groups_are_skipped_and_counted(trainer_store, tiny_model: Path) -> None:
    run_id = new_run(trainer_store, tiny_model, group_size=2, max_negatives=0)
    engine = TransformersBackend(tiny_model)
    record_group(trainer_store, engine, run_id, size=2, seed=1, max_tokens=4)  # version 0
    for version in (1, 2, 3):  # updates made elsewhere (no checkpoint here)
        trainer_store.append(run_stream_id(run_id), [PolicyUpdated(version=version,
                                                                   step=version)])
    engine.policy_version = 3
    record_group(trainer_store, engine, run_id, size=2, seed=2, max_tokens=4)  # version 3
    trainer = Trainer.open(trainer_store, run_id,
                           config=TrainerConfig(lr=1e-3, groups_per_step=4, max_staleness=1))
    result = trainer.step()
    assert result.trained and result.version == 4
    assert result.samples == 2 and result.skipped_stale == 2
    assert result.metrics["skipped_stale"] == 2.0
    with trainer_store.db.connection() as conn:
        fresh = {row[0] for row in conn.execute(
            "SELECT sample_id FROM samples WHERE run_id = %s AND policy_version = 3",
            (run_id,))}
    assert set(result.sample_ids) == fresh
    stats = Leasing(trainer_store).stats(run_id)
    assert stats["stale"] == 2 and stats["consumed"] == 2 and stats["ready"] == 0
    assert not trainer.step().trained
