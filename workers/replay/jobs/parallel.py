"""Projecting many episodes on several processes, so that a rebuild uses every core.

Replaying is CPU-bound Python (segmentation, merging, building samples), so threads would
share one core. ``ProjectionPool`` runs ``project_episodes`` in ``jobs`` worker processes
instead. Each process has its own connection pool and loads each tokenizer once.

Processes are started with ``spawn``: a child inherits no connection, thread or lock of its
parent. Episodes go out in batches of at most ``batch`` (``project.BATCH`` by default), cut
small enough that every process gets work. Each batch is one ``project_episodes`` call: one
read, one write transaction, idempotent. A process that dies therefore leaves whole episodes
projected or not projected at all, and projecting the same ids again finishes the job.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from types import TracebackType

from store.arguments import whole_number
from store.db import Database
from store.eventlog import EventStore
from workers.replay.jobs.project import BATCH, ProjectOutcome, project_episodes

__all__ = ["ProjectionPool"]

#: The worker process's store, opened once by ``_start``.
_store: EventStore | None = None


def _start(database_url: str, statement_timeout_ms: int) -> None:
    global _store
    _store = EventStore(Database(database_url, min_size=1, max_size=2,
                                 statement_timeout_ms=statement_timeout_ms))


def _project(episode_ids: list[str]) -> list[ProjectOutcome]:
    assert _store is not None, "the worker process was not started by ProjectionPool"
    return project_episodes(_store, episode_ids)


class ProjectionPool:
    """``jobs`` processes projecting episodes of the database at ``database_url``, at most
    ``batch`` episodes per read and write transaction (default ``project.BATCH``). Use it as a
    context manager, or call ``close``. Raises ValueError when ``jobs`` or ``batch`` is not a
    positive int or ``database_url`` is empty."""

    def __init__(self, database_url: str, *, jobs: int, batch: int | None = None,
                 statement_timeout_ms: int = 60_000) -> None:
        batch = BATCH if batch is None else batch
        for name, value in (("jobs", jobs), ("batch", batch)):
            whole_number(name, value)
        if not isinstance(database_url, str) or not database_url:
            raise ValueError(f"database_url must be a non-empty string, got {database_url!r}")
        self.jobs = jobs
        self.batch = batch
        self._executor = ProcessPoolExecutor(
            max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
            initializer=_start, initargs=(database_url, statement_timeout_ms))

    def project(self, episode_ids: Sequence[str]) -> list[ProjectOutcome]:
        """``project_episodes`` for ``episode_ids``, spread over the processes: one outcome per
        id, in order. Raises TypeError when ``episode_ids`` is not a list of strings; an error
        in a worker process (a database error, a process that died) propagates, with the
        batches that finished before it written."""
        if isinstance(episode_ids, (str, bytes)) or not isinstance(episode_ids, Sequence) \
                or not all(isinstance(e, str) for e in episode_ids):
            raise TypeError(f"episode_ids must be a list of strings, got {episode_ids!r:.80}")
        ids = list(episode_ids)
        size = max(1, min(self.batch, -(-len(ids) // self.jobs)))
        outcomes: list[ProjectOutcome] = []
        for batch in self._executor.map(_project, [ids[i:i + size]
                                                   for i in range(0, len(ids), size)]):
            outcomes.extend(batch)
        return outcomes

    def close(self) -> None:
        """Stop the worker processes (after the work already handed out)."""
        self._executor.shutdown(wait=True)

    def __enter__(self) -> ProjectionPool:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()
