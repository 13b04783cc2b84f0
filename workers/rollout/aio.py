"""Bridges between the asyncio agent loop and synchronous backends, sinks and callers.

- :func:`generate_async` awaits a backend's ``agenerate`` when it has one (the batching
  backends) and otherwise runs its ``generate`` in a thread, one request at a time per backend
  (the synchronous backends are not thread-safe), or on the loop's own thread for a backend
  whose ``bound_to_its_thread`` is true;
- :func:`append_async` awaits a sink's ``aappend`` when it has one and otherwise runs its
  ``append`` in a thread, so a database round trip never holds up the event loop;
- :func:`run_sync` runs a coroutine to its end for a caller without an event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import weakref
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from store.events import Event
from workers.engines.backend import GenerationRequest, GenerationResult

__all__ = ["append_async", "generate_async", "run_sync"]

T = TypeVar("T")

_locks: weakref.WeakKeyDictionary[Any, threading.Lock] = weakref.WeakKeyDictionary()
_locks_guard = threading.Lock()
_shared_lock = threading.Lock()


def _backend_lock(backend: Any) -> threading.Lock:
    """One lock per synchronous backend (a shared one for objects without weak references)."""
    with _locks_guard:
        try:
            lock = _locks.get(backend)
            if lock is None:
                lock = _locks[backend] = threading.Lock()
        except TypeError:
            lock = _shared_lock
        return lock


async def generate_async(backend: Any, request: GenerationRequest) -> GenerationResult:
    """Generate ``request`` on ``backend`` without blocking the event loop (module docstring);
    the backend's errors propagate."""
    agenerate = getattr(backend, "agenerate", None)
    if agenerate is not None:
        return await agenerate(request)
    if getattr(backend, "bound_to_its_thread", False):
        # An engine that must run on the thread that built it (vLLM's in-process CPU
        # engine checks its OpenMP threads): called here, holding up this loop meanwhile.
        return backend.generate(request)
    lock = _backend_lock(backend)

    def call() -> GenerationResult:
        with lock:
            return backend.generate(request)

    return await asyncio.to_thread(call)


async def append_async(sink: Any, stream_id: str, events: Sequence[Event]) -> object:
    """Append ``events`` to ``stream_id`` of ``sink`` without blocking the event loop (module
    docstring); the sink's errors propagate."""
    aappend = getattr(sink, "aappend", None)
    if aappend is not None:
        return await aappend(stream_id, events)
    return await asyncio.to_thread(sink.append, stream_id, events)


def run_sync(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine`` in a new event loop and return its result. From a thread that already
    runs an event loop the coroutine runs in a helper thread (a loop cannot be nested)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="run-sync") as pool:
        return pool.submit(asyncio.run, coroutine).result()
