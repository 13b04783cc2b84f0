"""Appends of concurrent coroutines gathered into shared transactions.

Many episodes played in one event loop each append a batch of events now and then. Written
one transaction each, the commits (and their WAL flushes) dominate the database's work. An
:class:`AppendBatcher` keeps, per event loop, one writer task: every append waiting when the
writer is free goes to the store together, through :meth:`EventStore.append_many` in a
thread, one transaction for all of them; appends arriving meanwhile form the next one.

While appends keep coming, transactions are spaced at least ``interval_s`` apart (measured
from the end of the previous one), so that each carries more batches: a transaction's cost
(the hand-off to the thread, two round trips, the commit and its WAL flush, the notify) is
mostly per transaction, not per event. Appends do not block generation (the agent loop
awaits them only at the end of an episode), so the wait costs the loop nothing but that
much later a durable ``episode_finished``. An append after a quiet spell is written at once.

Each append keeps its own answer (its ``AppendResult`` or the error :meth:`EventStore.append`
would raise for it); appends of one stream stay in the order they were awaited when each
waits for the previous one (as the agent loop does).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from store.arguments import whole_number
from store.events import Event

if TYPE_CHECKING:
    from store.recorder import AppendResult, Recorder

__all__ = ["AppendBatcher"]


class _LoopState:
    def __init__(self) -> None:
        self.pending: list[tuple[str, Sequence[Event], Any, asyncio.Future[Any]]] = []
        self.wake = asyncio.Event()
        self.writer: asyncio.Task[None] | None = None
        self.last_write = -math.inf  # when the last transaction ended (monotonic)


class AppendBatcher:
    """Gathers the appends of one store (module docstring). ``max_batches`` (>= 1) caps the
    appends of one transaction; ``interval_s`` (>= 0 seconds) is the least time from the end
    of one transaction to the start of the next while appends keep coming (a full
    transaction's worth of waiting appends goes at once). Raises ValueError for either out
    of range. ``transactions`` counts the transactions written and ``cpu_seconds`` the CPU
    time the writing threads spent in them (validation, encoding, the driver)."""

    def __init__(self, store: Recorder, *, max_batches: int = 256,
                 interval_s: float = 0.0) -> None:
        whole_number("max_batches", max_batches)
        if (isinstance(interval_s, bool) or not isinstance(interval_s, (int, float))
                or not 0 <= interval_s <= 60):
            raise ValueError(f"interval_s must be a number of seconds in [0, 60], "
                             f"got {interval_s!r}")
        self.store = store
        self.max_batches = max_batches
        self.interval_s = float(interval_s)
        self.transactions = 0
        self.cpu_seconds = 0.0  # CPU time of the writing threads in append_many, all loops
        self._cpu_lock = threading.Lock()
        self._states: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopState] = (
            weakref.WeakKeyDictionary())

    async def append(self, stream_id: str, events: Sequence[Event],
                     expected_version: Any = "any") -> AppendResult:
        """Append like :meth:`EventStore.append`, sharing a transaction with the appends
        awaited alongside; raises what that append would raise."""
        loop = asyncio.get_running_loop()
        state = self._states.get(loop)
        if state is None:
            state = self._states[loop] = _LoopState()
        if state.writer is None or state.writer.done():
            state.writer = loop.create_task(self._write(state))
        future: asyncio.Future[Any] = loop.create_future()
        # A copy of a list, which its caller may reuse while the append waits; anything else
        # goes as it came, for the store to refuse as ``append`` does (``list()`` would make
        # a dict's keys a batch).
        batch = list(events) if isinstance(events, (list, tuple)) else events
        state.pending.append((stream_id, batch, expected_version, future))
        state.wake.set()
        return await future

    async def _write(self, state: _LoopState) -> None:
        while True:
            await state.wake.wait()
            state.wake.clear()
            while state.pending:
                wait = self.interval_s - (time.monotonic() - state.last_write)
                if wait > 0 and len(state.pending) < self.max_batches:
                    await asyncio.sleep(wait)  # appends keep coming: gather more
                batch = state.pending[: self.max_batches]
                del state.pending[: self.max_batches]
                try:
                    answers: list[Any] = await asyncio.to_thread(
                        self._append_many, [(s, e, x) for s, e, x, _ in batch])
                except Exception as exc:  # the whole transaction failed: every append did
                    answers = [exc] * len(batch)
                self.transactions += 1
                state.last_write = time.monotonic()
                for (_, _, _, future), answer in zip(batch, answers, strict=True):
                    if future.done():
                        continue
                    if isinstance(answer, BaseException):
                        future.set_exception(answer)
                    else:
                        future.set_result(answer)

    def _append_many(self, batches: list[tuple[str, Sequence[Event], Any]]) -> list[Any]:
        started = time.thread_time()
        try:
            return self.store.append_many(batches)
        finally:
            spent = time.thread_time() - started
            with self._cpu_lock:
                self.cpu_seconds += spent
