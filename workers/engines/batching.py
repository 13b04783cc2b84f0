"""Gathering concurrent generation requests into batches for an engine that runs one batch at
a time (the transformers backend's padded ``generate``).

A :class:`BatchScheduler` owns one thread. Episodes running in any event loop ``await
submit(request)``; the thread takes every request waiting (up to ``max_batch``) that can share
a batch with the oldest one (same ``key``), runs them in one call and hands each result back
to the loop that asked for it. While a batch runs, new requests wait and form the next one, so
the engine is never idle while requests are waiting, but for one short wait: a request that
finds the engine idle waits while others keep arriving (``gather_s`` apart at most), so that
episodes started together share a batch.

When the batch call raises, every request of that batch gets the exception. When the scheduler
is closed, or its thread died, waiting and new requests get :class:`EngineStopped`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from store.arguments import whole_number
from workers.engines.backend import GenerationRequest, GenerationResult

__all__ = ["BatchScheduler", "EngineStopped"]

# The longest a gathering wait runs, in gather windows: a steady trickle of requests (each
# within a window of the last) never holds an idle engine longer than this.
_GATHER_ROUNDS = 25


class EngineStopped(RuntimeError):
    """The engine behind a scheduler no longer takes requests (closed, or its thread died)."""


class BatchScheduler:
    """One thread running batches of concurrently submitted requests (module docstring).

    ``run_batch(requests) -> results`` (one result per request, in order) runs in the thread;
    ``key(request)`` says which requests may share a batch; ``max_batch`` >= 1 the most
    requests per call; ``gather_s`` the quiet gap that ends a burst of requests: when a
    request finds the engine idle and fewer than ``max_batch`` are waiting, the thread waits
    for more while they keep arriving at most ``gather_s`` apart (at most 25 such gaps in
    all); requests that queued while a batch ran go at once. Bad values raise ValueError.
    """

    def __init__(self, run_batch: Callable[[Sequence[GenerationRequest]],
                                           Sequence[GenerationResult]],
                 *, key: Callable[[GenerationRequest], Hashable], max_batch: int = 64,
                 gather_s: float = 0.002, name: str = "batch") -> None:
        whole_number("max_batch", max_batch)
        if not isinstance(gather_s, (int, float)) or not 0 <= gather_s < 1:
            raise ValueError(f"gather_s must be in [0, 1) seconds, got {gather_s!r}")
        self.run_batch = run_batch
        self.key = key
        self.max_batch = max_batch
        self.gather_s = float(gather_s)
        self.batches = 0
        self.largest_batch = 0
        self._waiting: deque[tuple[GenerationRequest, asyncio.AbstractEventLoop,
                                   asyncio.Future[GenerationResult]]] = deque()
        self._condition = threading.Condition()
        self._stopped: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name=f"{name}-scheduler",
                                        daemon=True)
        self._thread.start()

    async def submit(self, request: GenerationRequest) -> GenerationResult:
        """Generate ``request`` in the next batch it fits; raises what the batch call raised,
        or :class:`EngineStopped`."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[GenerationResult] = loop.create_future()
        with self._condition:
            if self._stopped is not None:
                raise EngineStopped(f"the engine is stopped: {self._stopped}")
            self._waiting.append((request, loop, future))
            self._condition.notify()
        return await future

    def close(self, reason: str = "the scheduler was closed") -> None:
        """Stop the thread; waiting requests get :class:`EngineStopped`."""
        with self._condition:
            if self._stopped is None:
                self._stopped = EngineStopped(reason)
            self._condition.notify_all()
        self._thread.join(timeout=30)
        self._fail_waiting()

    @property
    def alive(self) -> bool:
        """True while the scheduler takes requests."""
        return self._stopped is None and self._thread.is_alive()

    def _take(self) -> list[tuple[GenerationRequest, asyncio.AbstractEventLoop, Any]]:
        with self._condition:
            # Requests that queued while a batch ran go at once; a first request to an idle
            # engine waits a moment for the ones submitted with it.
            idle = not self._waiting
            while not self._waiting and self._stopped is None:
                self._condition.wait()
            if self._stopped is not None:
                return []
            if idle and len(self._waiting) < self.max_batch and self.gather_s > 0:
                self._gather()
            first = self.key(self._waiting[0][0])
            taken: list[tuple[GenerationRequest, asyncio.AbstractEventLoop,
                              asyncio.Future[GenerationResult]]] = []
            kept: deque[tuple[GenerationRequest, asyncio.AbstractEventLoop,
                              asyncio.Future[GenerationResult]]] = deque()
            while self._waiting:
                item = self._waiting.popleft()
                if len(taken) < self.max_batch and self.key(item[0]) == first:
                    taken.append(item)
                else:
                    kept.append(item)
            self._waiting = kept
            return taken

    def _gather(self) -> None:
        """Wait, holding the condition, while requests keep coming: until none arrived for
        ``gather_s``, ``max_batch`` are waiting, or ``_GATHER_ROUNDS`` × ``gather_s`` passed.

        Episodes started together submit one after the other, each woken by the one before,
        so the first request rarely arrives with the rest: a single wait would return at the
        next arrival (a notify ends it) and run a batch of one or two, with the others
        waiting a whole batch for the next. On an engine whose step is slow (a real model
        on a GPU through transformers) that halves the throughput of a burst."""
        deadline = time.monotonic() + _GATHER_ROUNDS * self.gather_s
        count = len(self._waiting)
        while count < self.max_batch and self._stopped is None:
            left = min(self.gather_s, deadline - time.monotonic())
            if left <= 0:
                return
            self._condition.wait(left)
            if len(self._waiting) == count:  # quiet for gather_s: the burst is over
                return
            count = len(self._waiting)

    def _serve(self) -> None:
        try:
            while True:
                taken = self._take()
                if not taken:
                    return
                self.batches += 1
                self.largest_batch = max(self.largest_batch, len(taken))
                try:
                    results: Sequence[Any] = self.run_batch([item[0] for item in taken])
                    if len(results) != len(taken):
                        raise RuntimeError(f"the engine returned {len(results)} results for "
                                           f"{len(taken)} requests")
                except Exception as exc:  # every request of the batch learns why
                    results = [exc] * len(taken)
                for (_, loop, future), result in zip(taken, results, strict=True):
                    _deliver(loop, future, result)
        except BaseException as exc:  # the thread is dying: nobody may wait forever
            with self._condition:
                self._stopped = EngineStopped(f"the scheduler thread died: {exc!r}")
            raise
        finally:
            self._fail_waiting()

    def _fail_waiting(self) -> None:
        with self._condition:
            waiting, self._waiting = list(self._waiting), deque()
            error = self._stopped or EngineStopped("the scheduler stopped")
        for _, loop, future in waiting:
            _deliver(loop, future, EngineStopped(str(error)))


def _deliver(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], result: Any) -> None:
    def settle() -> None:
        if future.done():  # the episode was cancelled meanwhile
            return
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # that loop is closed: nobody waits for this result any more
        pass
