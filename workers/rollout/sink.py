"""Where the agent loop writes its events: the one-method :class:`EventSink` seam.

The signature is the one of the store's ``EventStore.append(stream_id, events)``, so the event
store is itself a sink. :class:`ListSink` keeps events in memory (tests, dry runs, batching
before a bulk import).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from store.events import Event

__all__ = ["EventSink", "ListSink"]


@runtime_checkable
class EventSink(Protocol):
    """Appends events to a stream (an episode id, or ``run-<run_id>``)."""

    def append(self, stream_id: str, events: Sequence[Event]) -> object:
        """Append ``events`` in order to ``stream_id``; raise on failure."""
        ...


class ListSink:
    """An in-memory sink: ``streams`` maps a stream id to its events in append order."""

    def __init__(self) -> None:
        self.streams: dict[str, list[Event]] = {}

    def append(self, stream_id: str, events: Sequence[Event]) -> int:
        """Append and return the stream's new length. Raises ValueError for an empty stream
        id or an empty batch and TypeError for an item that is not an Event."""
        if not isinstance(stream_id, str) or not stream_id:
            raise ValueError(f"stream_id must be a non-empty string, got {stream_id!r}")
        batch = list(events)
        if not batch:
            raise ValueError("events must not be empty")
        for index, event in enumerate(batch):
            if not isinstance(event, Event):
                raise TypeError(f"events[{index}] must be an Event, got {type(event).__name__}")
        stream = self.streams.setdefault(stream_id, [])
        stream.extend(batch)
        return len(stream)

    async def aappend(self, stream_id: str, events: Sequence[Event]) -> int:
        """:meth:`append` for the asyncio agent loop (in memory: no thread needed)."""
        return self.append(stream_id, events)

    def events(self, stream_id: str) -> list[Event]:
        """The events of ``stream_id`` (empty list when unknown)."""
        return list(self.streams.get(stream_id, []))

    def types(self, stream_id: str) -> list[str]:
        """The event type names of ``stream_id`` in order."""
        return [event.type for event in self.streams.get(stream_id, [])]
