"""Writing an episode's events so that retries and duplicate workers cannot corrupt it.

:class:`EpisodeWriter` is an :class:`~workers.rollout.sink.EventSink` in front of an event log
(the :class:`~store.eventlog.EventStore`, or a client of the HTTP API with the same
``append(stream_id, events, expected_version)`` method). For every stream it writes it:

- gives each event a deterministic id, ``uuid5(namespace, "<stream_id>/<version>")``: the same
  event at the same place always has the same id, so an append that is retried after an
  unknown outcome (a timeout after the commit) is recognised by the log as a duplicate and
  stored once;
- appends with the expected version: the first batch of a stream the writer starts expects
  the stream not to exist, each later batch the version the previous one left. A second
  writer on the same stream (a redelivered task while the first still runs) gets a
  ``ConflictError`` instead of interleaving its events.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from store.arguments import whole_number
from store.events import Event

__all__ = ["EpisodeWriter", "VersionedLog", "deterministic_event_id"]


@runtime_checkable
class VersionedLog(Protocol):
    """An event log with optimistic concurrency (the store's ``append`` and
    ``stream_version`` signatures)."""

    def append(self, stream_id: str, events: Sequence[Event],
               expected_version: Any = ...) -> Any:
        """Append ``events``; raise ``ConflictError`` when the stream is not at
        ``expected_version``."""
        ...

    def stream_version(self, stream_id: str) -> int:
        """The number of events in ``stream_id`` (0 when it does not exist)."""
        ...


def deterministic_event_id(namespace: uuid.UUID, stream_id: str, version: int) -> uuid.UUID:
    """The id of the event at ``version`` (1-based) of ``stream_id`` under ``namespace``.
    Raises ValueError for a version below 1."""
    whole_number("version", version)
    return uuid.uuid5(namespace, f"{stream_id}/{version}")


class EpisodeWriter:
    """Deterministic ids and expected versions for the streams it writes (module docstring).

    ``log`` the event log; ``namespace`` the uuid namespace of the event ids (derive it from
    what identifies the work, e.g. the group). ``start(stream_id, version)`` declares a stream
    that already holds ``version`` events (to append to it); a stream not declared must not
    exist yet. Raises TypeError when ``log`` has no ``append``.
    """

    def __init__(self, log: VersionedLog, *, namespace: uuid.UUID) -> None:
        if not isinstance(log, VersionedLog):
            raise TypeError(f"log must have append(stream_id, events, expected_version) and "
                            f"stream_version(stream_id) methods, got {type(log).__name__}")
        if not isinstance(namespace, uuid.UUID):
            raise TypeError(f"namespace must be a uuid.UUID, got {type(namespace).__name__}")
        self.log = log
        self.namespace = namespace
        self.versions: dict[str, int] = {}

    def start(self, stream_id: str, version: int) -> None:
        """Continue ``stream_id`` from ``version`` (its current number of events).
        Raises ValueError for a negative version."""
        whole_number("version", version, minimum=0)
        self.versions[stream_id] = version

    def append(self, stream_id: str, events: Sequence[Event]) -> object:
        """Append ``events`` to ``stream_id`` with deterministic ids at the expected version;
        the log's errors (conflict, validation, transient) propagate and the writer's
        version is left unchanged. Raises ValueError for an empty batch."""
        current, stamped = self._stamp(stream_id, events)
        result = self.log.append(stream_id, stamped, current)
        self.versions[stream_id] = current + len(stamped)
        return result

    async def aappend(self, stream_id: str, events: Sequence[Event]) -> object:
        """:meth:`append` for the agent loop: through the log's ``aappend`` when it has one
        (concurrent episodes share transactions), else in a thread. Same errors."""
        current, stamped = self._stamp(stream_id, events)
        aappend = getattr(self.log, "aappend", None)
        if aappend is not None:
            result = await aappend(stream_id, stamped, current)
        else:
            result = await asyncio.to_thread(self.log.append, stream_id, stamped, current)
        self.versions[stream_id] = current + len(stamped)
        return result

    def _stamp(self, stream_id: str, events: Sequence[Event]) -> tuple[int, list[Event]]:
        batch = list(events)
        if not batch:
            raise ValueError("events must not be empty")
        current = self.versions.get(stream_id, 0)
        return current, [
            event.model_copy(update={"event_id": deterministic_event_id(
                self.namespace, stream_id, current + offset)})
            for offset, event in enumerate(batch, start=1)
        ]
