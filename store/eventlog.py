"""The event log as a process opens it: :class:`EventStore`.

An ``EventStore`` is the recorder (``store.recorder``: every append and read of the events
table, the one code that writes events) opened as the settings say, with what a process
wants around it:

- ``aappend``: coroutines' appends gathered into shared transactions
  (``store.append_batcher``), the third way in beside ``append`` and ``append_many``;
- ``subscribe``: following the log as it grows (``store.subscription``);
- lookups of runs and episodes, kept as methods for their callers; they are the functions of
  ``store.queries``, where new code finds them and every other read.

The append's vocabulary (``ANY``, ``NO_STREAM``, ``AppendResult``, ``LogPosition``…) is
importable from here as from the modules that define it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

from store import errors, queries, subscription
from store.append_batcher import AppendBatcher
from store.db import Database
from store.events import Event, RunCreated
from store.queries import EpisodeSummary
from store.recorder import AppendResult, Recorder
from store.rows import START, LogPosition, RecordedEvent
from store.settings import Settings
from store.stream_rules import ANY, NO_STREAM, ExpectedVersion, run_stream_id

__all__ = [
    "EventStore",
    "AppendResult",
    "EpisodeSummary",
    "ExpectedVersion",
    "ANY",
    "NO_STREAM",
    "LogPosition",
    "RecordedEvent",
    "START",
    "run_stream_id",
]


class EventStore(Recorder):
    """Append-only event log on one PostgreSQL database (``Recorder``'s appends and reads,
    and the module docstring's additions).

    Thread-safe: connections come from a pool. Open with ``EventStore.open()`` (settings and
    the embedded default) or ``EventStore(Database(url))``.
    """

    def __init__(self, database: Database, settings: Settings | None = None) -> None:
        super().__init__(database, settings)
        self._batcher: AppendBatcher | None = None
        self._batcher_lock = threading.Lock()

    @classmethod
    def open(cls, settings: Settings | None = None, *, migrate: bool | None = None) -> EventStore:
        """Connect as the settings say. With no database URL, start the embedded server and
        migrate it; with a URL, migrate only when ``migrate`` is True and otherwise refuse a
        database that is not at the newest revision, naming the command that fixes it. A
        database that cannot be reached is a ``ConfigurationError`` naming the setting."""
        from store import migrate as migrations
        from store import preflight

        settings = settings or Settings()
        url = preflight.database_url(settings)
        if migrate is None:
            migrate = settings.database_url is None
        if migrate:
            migrations.upgrade(url)
        else:
            current, head = migrations.current_revision(url), migrations.head_revision()
            if current != head:
                raise errors.StoreError(
                    f"database schema is at revision {current}, this code needs {head}: "
                    "run `trajstore migrate`"
                )
        db = Database(
            url,
            min_size=settings.pool_min_size,
            max_size=settings.pool_max_size,
            statement_timeout_ms=settings.statement_timeout_ms,
        )
        return cls(db, settings)

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> EventStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def aappend(self, stream_id: str, events: Sequence[Event],
                      expected_version: ExpectedVersion = ANY) -> AppendResult:
        """:meth:`append` for coroutines: appends awaited together from one event loop share
        one transaction (:class:`~store.append_batcher.AppendBatcher`), spaced at least
        ``settings.append_interval_ms`` apart while appends keep coming. Same answers and
        errors as :meth:`append`."""
        with self._batcher_lock:
            if self._batcher is None:
                self._batcher = AppendBatcher(
                    self, interval_s=self.settings.append_interval_ms / 1000)
        return await self._batcher.append(stream_id, events, expected_version)

    @property
    def append_batcher(self) -> AppendBatcher | None:
        """The batcher :meth:`aappend` writes through (its transaction count and CPU time),
        None before the first ``aappend``."""
        return self._batcher

    def subscribe(
        self,
        after: LogPosition | None = None,
        *,
        types: Sequence[str] | None = None,
        batch_size: int = 500,
        poll_interval: float = 1.0,
        stop: threading.Event | None = None,
    ) -> Iterator[list[RecordedEvent]]:
        """Yield batches of new events forever (until ``stop`` is set), in commit order:
        :func:`store.subscription.subscribe` on this store."""
        return subscription.subscribe(self, after, types=types, batch_size=batch_size,
                                      poll_interval=poll_interval, stop=stop)

    # --- lookups (store.queries) ---------------------------------------------------------

    def counts_by_type(self) -> dict[str, int]:
        """Number of stored events of each type (:func:`store.queries.counts_by_type`)."""
        return queries.counts_by_type(self)

    def get_run(self, run_id: str) -> RunCreated:
        """The ``run_created`` event of a run; ``NotFoundError`` when there is none
        (:func:`store.queries.get_run`)."""
        return queries.get_run(self, run_id)

    def list_runs(self) -> list[RecordedEvent]:
        """Every run's ``run_created`` event, oldest first
        (:func:`store.queries.created_runs`)."""
        return queries.created_runs(self)

    def list_episodes(self, run_id: str, *, group_id: str | None = None
                      ) -> list[EpisodeSummary]:
        """The episodes of a run (optionally one group) with their status and reward
        (:func:`store.queries.episode_summaries`)."""
        return queries.episode_summaries(self, run_id, group_id=group_id)

    def get_episode(self, episode_id: str) -> list[RecordedEvent]:
        """Every event of an episode; ``NotFoundError`` when the stream is empty or is not
        an episode (:func:`store.queries.get_episode`)."""
        return queries.get_episode(self, episode_id)
