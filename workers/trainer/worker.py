"""The trainer inside a Celery worker: one cached :class:`~workers.trainer.loop.Trainer` per run.

A worker on the ``train`` queue runs with concurrency 1, so its process trains one step at a
time and keeps the model, the optimizer moments and the tokenizer in memory between tasks
instead of reloading them from the newest checkpoint every step. The cache holds a few runs,
least recently used first out. A step that fails drops its run's trainer, so the next task
reopens it from the newest checkpoint.

The Celery worker has no rollout engine in its process: rollout workers load the checkpoint
named by the run's newest ``policy_updated`` event. A process that hosts both (a demo, a
single-machine setup) attaches its engine with :func:`attach_engine`.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from store.eventlog import EventStore
from workers.engines.backend import WeightUpdatable
from workers.trainer.config import TrainerConfig
from workers.trainer.loop import Trainer

__all__ = ["MAX_CACHED_RUNS", "attach_engine", "cached_runs", "forget", "run_train_step"]

log = logging.getLogger(__name__)

MAX_CACHED_RUNS = 2
_trainers: OrderedDict[str, tuple[TrainerConfig, Trainer]] = OrderedDict()
_engines: dict[str, WeightUpdatable] = {}
_lock = threading.Lock()


def attach_engine(run_id: str, engine: WeightUpdatable | None) -> None:
    """Push ``run_id``'s new weights to ``engine`` after each step of this process (None
    detaches). Raises TypeError for an engine without ``update_weights``."""
    if engine is not None and not isinstance(engine, WeightUpdatable):
        raise TypeError(f"engine must have update_weights(weights, *, version), "
                        f"got {type(engine).__name__}")
    with _lock:
        if engine is None:
            _engines.pop(run_id, None)
        else:
            _engines[run_id] = engine
        cached = _trainers.get(run_id)
        if cached is not None:
            cached[1].engine = engine


def forget(run_id: str | None = None) -> None:
    """Drop the cached trainer of ``run_id`` (every run when None)."""
    with _lock:
        if run_id is None:
            _trainers.clear()
        else:
            _trainers.pop(run_id, None)


def cached_runs() -> list[str]:
    """Runs whose trainer this process holds, least recently used first."""
    with _lock:
        return list(_trainers)


def _trainer(store: EventStore, run_id: str, config: TrainerConfig) -> Trainer:
    with _lock:
        cached = _trainers.get(run_id)
        if cached is not None and cached[0] == config and not cached[1].broken:
            _trainers.move_to_end(run_id)
            return cached[1]
        _trainers.pop(run_id, None)
        engine = _engines.get(run_id)
    trainer = Trainer.open(store, run_id, config=config, engine=engine)
    log.info("opened the trainer of run %s (step %d, device %s)", run_id, trainer.steps_done,
             trainer.device)
    with _lock:
        _trainers[run_id] = (config, trainer)
        while len(_trainers) > MAX_CACHED_RUNS:
            _trainers.popitem(last=False)
    return trainer


def run_train_step(store: EventStore, run_id: str, *,
                   config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One training step of ``run_id`` with this process's cached trainer, opened on first use
    (``config`` overrides :class:`TrainerConfig` defaults; a different ``config`` reopens the
    trainer). Returns a JSON-ready summary: ``run_id``, ``version`` (None when nothing was
    ready), ``step``, ``samples``, ``skipped_stale``, ``metrics``.

    Raises TypeError naming an unknown config field, ValueError for a bad value, and whatever
    the step raises (after dropping the cached trainer)."""
    settings = TrainerConfig(**dict(config or {}))
    trainer = _trainer(store, run_id, settings)
    try:
        result = trainer.step()
    except BaseException:
        forget(run_id)
        raise
    if result.trained:
        log.info("run %s: policy version %d from %d samples", run_id, result.version,
                 result.samples)
    return {"run_id": run_id, "version": result.version, "step": result.step,
            "samples": result.samples, "skipped_stale": result.skipped_stale,
            "metrics": result.metrics}
