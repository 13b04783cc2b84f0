"""A replay worker's pool processes start with what a replay loads (``workers.replay.warm``):
the main process imports it before the pool forks, so a slot's first replay does not spend
seconds importing transformers and torch while a neighbour's episode waits on it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psutil

from workers.replay.warm import REPLAY_MODULES, import_replay_modules


def _has_torch(process: psutil.Process) -> bool:
    return any("libtorch" in Path(m.path).name for m in process.memory_maps(grouped=True))


def test_every_pool_process_of_a_replay_worker_has_torch_loaded_before_its_first_replay(
        start_worker: Any) -> None:
    worker = start_worker("--queues", "replay", "--concurrency", "2")
    worker.wait_ready()
    processes = psutil.Process(worker.proc.pid).children(recursive=True)
    # The worker's main process and its two pool processes, none of which has replayed.
    assert len(processes) >= 2, processes
    assert all(_has_torch(p) for p in [psutil.Process(worker.proc.pid), *processes])
    assert "replay warm-up: imported" in worker.log_path.read_text()


def test_a_training_worker_does_not_warm_replay(start_worker: Any) -> None:
    worker = start_worker("--queues", "train", "--concurrency", "1")
    worker.wait_ready()
    assert "replay warm-up" not in worker.log_path.read_text()


def test_a_module_that_cannot_be_imported_is_named_not_raised(
        monkeypatch: Any, caplog: Any) -> None:
    import workers.replay.warm as warm

    monkeypatch.setattr(warm, "REPLAY_MODULES", (*REPLAY_MODULES, "no_such_module_here"))
    assert import_replay_modules() == ["no_such_module_here"]
    assert "no_such_module_here could not be imported" in caplog.text
