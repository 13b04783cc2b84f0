"""Following the log: every new event in commit order, soon after its append commits.

A subscription reads the gap-free log (``Recorder.read_all``) from a checkpoint, one batch
after another, and then waits: LISTEN/NOTIFY wakes it as soon as an append commits (a
statement-level trigger of the events table sends ``NOTIFY trajstore_events``, delivered at
commit), and polling every ``poll_interval`` seconds is the fallback (a missed notification
delays reading but never loses an event). An event committed behind an older transaction
still running (anywhere on the server: ``Recorder.read_all`` reads up to the oldest one) is
not readable when its notification arrives, and the transaction that holds it back may
end without appending (no notification then): while events are so held back
(``Recorder.held_back``), the subscription reads again after ``HELD_BACK_S`` seconds,
doubling up to one second, instead of waiting for a notification. What a follower has acted
on is its own to save (``store.followers``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from store import errors
from store.db import connect
from store.rows import START, LogPosition, RecordedEvent

if TYPE_CHECKING:
    import psycopg

    from store.recorder import Recorder

__all__ = ["HELD_BACK_S", "NOTIFY_CHANNEL", "Listener", "subscribe"]

#: The channel the events table's trigger notifies at every appending statement's commit.
NOTIFY_CHANNEL = "trajstore_events"

#: First wait before reading again while committed events are held back (module docstring).
HELD_BACK_S = 0.02


class Listener:
    """A dedicated autocommit connection to ``url`` LISTENing for append notifications; one
    that cannot connect (or whose connection dies) waits on a timer instead."""

    def __init__(self, url: str) -> None:
        self._conn: psycopg.Connection | None = None
        try:
            self._conn = connect(url, autocommit=True)
            self._conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
        except errors.StoreError:
            self._conn = None  # polling only

    def wait(self, timeout: float) -> bool:
        """Block until a notification or ``timeout`` seconds; True when notified."""
        if self._conn is None:
            time.sleep(timeout)
            return False
        try:
            for _ in self._conn.notifies(timeout=timeout, stop_after=1):
                return True
        except Exception:  # the connection died: keep polling on a timer
            self._conn = None
            time.sleep(timeout)
        return False

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


def subscribe(
    recorder: Recorder,
    after: LogPosition | None = None,
    *,
    types: Sequence[str] | None = None,
    batch_size: int = 500,
    poll_interval: float = 1.0,
    stop: threading.Event | None = None,
    listen: Callable[[str], Listener] = Listener,
) -> Iterator[list[RecordedEvent]]:
    """Yield batches of at most ``batch_size`` events after ``after`` (the start of the log
    when None) in commit order, forever, until ``stop`` is set; ``types`` keeps only those
    types. ``listen(url)`` makes the listener the subscription waits on (its own connection,
    closed when the iteration ends). Raises what ``Recorder.read_all`` raises: a
    ``ValidationError`` for a ``batch_size`` below 1, ``TransientError`` when the database
    cannot be reached."""
    position = after or START
    listener = listen(recorder.db.url)
    held_s = HELD_BACK_S
    try:
        while stop is None or not stop.is_set():
            batch = recorder.read_all(position, limit=batch_size, types=types)
            if batch:
                position = batch[-1].log_position
                yield batch
                if len(batch) == batch_size:
                    continue
            if recorder.held_back(position):
                # Readable once the older transaction ends, which may notify nobody.
                if stop is not None:
                    stop.wait(held_s)
                else:
                    time.sleep(held_s)
                held_s = min(1.0, 2 * held_s)
                continue
            held_s = HELD_BACK_S
            # Wait in short slices so that setting ``stop`` ends the loop promptly.
            waited = 0.0
            while waited < poll_interval and not (stop is not None and stop.is_set()):
                if listener.wait(min(1.0, poll_interval - waited)):
                    break
                waited += min(1.0, poll_interval - waited)
    finally:
        listener.close()
