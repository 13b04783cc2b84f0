"""Celery tasks: thin shells that take ids, set the retry policy and call a function."""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery.signals import worker_init, worker_process_init, worker_ready, worker_shutdown

from store.errors import TransientError
from store.eventlog import EventStore
from store.settings import get_settings
from workers.app import app

__all__ = ["replay_episode", "sweep", "train_step", "worker_store"]

_dispatcher: threading.Event | None = None


@worker_ready.connect
def _start_replay_dispatcher(sender: Any = None, **_: Any) -> None:
    """A worker that consumes the ``replay`` queue follows the log and queues the replay of
    every finished episode (``workers.replay.jobs.dispatch``); one copy leads at a time."""
    global _dispatcher
    if not app.conf.get("trajstore_replay_dispatch"):
        return
    from workers.replay.jobs.dispatch import start_dispatcher

    _thread, _dispatcher = start_dispatcher(
        lambda: EventStore.open(get_settings()),
        poll_interval=get_settings().sweep_interval_s)


@worker_shutdown.connect
def _stop_replay_dispatcher(**_: Any) -> None:
    if _dispatcher is not None:
        _dispatcher.set()


@worker_init.connect
def _warm_replay_imports(**_: Any) -> None:
    """A worker on the ``replay`` queue imports what a replay loads before its pool forks
    (``workers.replay.warm.import_replay_modules``): each pool process inherits it, so no
    process's first replay spends seconds importing transformers and torch while the
    episode waits (a fresh slot's first replay took 2.6 to 12 s on a busy two-core machine,
    against tens of milliseconds warm). Every worker then freezes what it holds out of the
    garbage collector's full collections (``store.heap``, ``GC_FREEZE_AFTER_MS``)."""
    from store import heap

    heap.install(get_settings().gc_freeze_after_ms)
    if app.conf.get("trajstore_replay_dispatch"):
        from workers.replay.warm import import_replay_modules

        import_replay_modules()
    # What the pool processes inherit is long-lived: out of their full collections
    # (store.heap), and their copies of its pages stay shared.
    frozen = heap.freeze(collect=True)
    logging.getLogger(__name__).info(
        "%d long-lived objects kept out of the garbage collector's full collections "
        "(store.heap)", frozen)


@worker_process_init.connect
def _isolate_struck_renders(**_: Any) -> None:
    """A pool process of a worker on the ``replay`` queue renders the templates of projects
    whose renders ran past their budget lately on a thread at the lowest CPU priority
    (``workers.engines.render.isolate_struck_renders``), and replays the episodes of projects
    over their share of its replay CPU on a thread at ``REPLAY_OVER_SHARE_NICE``
    (``workers.replay.jobs.shares``). Celery sends this signal in the processes of the
    prefork pool only: a worker of threads (a replay and rollout worker) keeps every render
    and replay in its caller's thread, as the API process does."""
    if not app.conf.get("trajstore_replay_dispatch"):
        return
    from workers.engines.render import isolate_struck_renders
    from workers.replay.jobs.shares import start_over_share_thread

    isolate_struck_renders()
    start_over_share_thread(get_settings())


_store: EventStore | None = None
_lock = threading.Lock()


def worker_store() -> EventStore:
    """The worker process's store, opened on first use (after the pool forks)."""
    global _store
    with _lock:
        if _store is None:
            _store = EventStore.open(get_settings())
        return _store


@app.task(name="trajstore.replay_episode", acks_late=True, autoretry_for=(TransientError,),
          retry_backoff=True, retry_backoff_max=60, max_retries=20)
def replay_episode(episode_id: str, *, budget: dict[str, Any] | None = None) -> str:
    """Project one finished episode (idempotent: a redelivery does nothing), within its
    project's replay budget when it carries one (``workers.fair``: the dispatcher queues it
    on a place of the project, or it is parked here, answering ``parked``, when that place
    expired meanwhile and the project's others are taken, or refused when the project has
    ``replay_project_parked`` parked already, answering ``parked`` too, and left to the
    sweep; either way the place is handed on when the replay ends). A retry after a
    transient error is sent with the same budget."""
    from workers import fair
    from workers.replay.jobs.project import fault_delay, project_episode
    from workers.replay.jobs.shares import replay_at_priority

    settings = get_settings()
    outcome = fair.within(
        settings, fair.REPLAY, "trajstore.replay_episode", [episode_id], {}, budget,
        lambda: replay_at_priority(settings, budget, lambda: project_episode(
            worker_store(), episode_id, before_commit=fault_delay(settings)).outcome))
    return "parked" if outcome is None else outcome


@app.task(name="trajstore.sweep", acks_late=True, autoretry_for=(TransientError,),
          retry_backoff=True, max_retries=5)
def sweep(limit: int = 200) -> int:
    """Queue within the replay budget the replay of finished episodes that have no
    projection and no replay on its way (a lost message, one past its project's
    ``replay_project_parked``), after handing on the places of budgeted tasks that never
    ended (``workers.fair.release_stranded``); project them here when the broker cannot be
    reached. Returns how many it queued, parked or wrote
    (``sweep_unprojected``)."""
    from workers.replay.jobs.sweep import (
        abort_stale_episodes,
        finish_idle_rollouts,
        sweep_unprojected,
    )

    store = worker_store()
    settings = get_settings()
    finish_idle_rollouts(store, timeout_s=settings.rollout_idle_timeout_s, limit=limit)
    abort_stale_episodes(store, timeout_s=settings.episode_timeout_s, limit=limit)
    return sweep_unprojected(store, limit=limit, leave_budgeted=True)


@app.task(name="trajstore.train_step", acks_late=True, autoretry_for=(TransientError,),
          retry_backoff=True, retry_backoff_max=60, max_retries=5)
def train_step(run_id: str, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """One training step of ``run_id`` on this worker's cached trainer (lease, update, record,
    acknowledge); ``config`` overrides the trainer's hyperparameters. Nothing ready: a summary
    with version None. A worker that dies mid-step leaves its lease to expire."""
    from workers.trainer.worker import run_train_step

    return run_train_step(worker_store(), run_id, config=config)
