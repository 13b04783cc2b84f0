"""Long-lived objects kept out of Python's cyclic garbage collector, so that its full
collections stay short in a serving process.

A process that has imported torch and transformers and loaded a tokenizer tracks about half
a million container objects. A full collection walks every one of them: 0.3 to 0.6 s on a
two-core machine, during which no thread of the process runs. In the API such a pause is a
neighbour's request held that long; under a flood of ordinary requests (many allocations)
full collections come more often, so the neighbour's slowest requests were these pauses.
Almost none of those objects ever becomes garbage: the modules, the tokenizer, the model.

:func:`freeze` moves every object the collector tracks now into its permanent generation
(``gc.freeze``): collections skip them from then on, and they are still freed when their
last reference goes. A process freezes after its start (the API once its engine is loaded,
a replay worker before its pool forks, where it also spares the children's copies of the
pages) and after each tokenizer it loads. :func:`install` covers the loads nobody named: a
full collection that took longer than ``pause_ms`` freezes what survived it (the survivors
of a full collection are the long-lived objects), so that such a pause comes once, not
again and again.

What it costs: a reference cycle among frozen objects is not reclaimed until they are
unfrozen. A cache that drops a large object with cycles (the tokenizer cache evicting a
tokenizer) calls :func:`release`: everything returns to the collector, a full collection
reclaims the dropped object (one pause), and the survivors are frozen again. Library code
freezes nothing in a process that did not :func:`install` (a user's own script).
"""

from __future__ import annotations

import gc
import logging
import math
import threading
import time
from typing import Any

__all__ = ["freeze", "install", "installed_pause_ms", "loaded", "release"]

log = logging.getLogger(__name__)

_state: dict[str, Any] = {"installed": False, "pause_ms": None, "started": 0.0,
                          "logged": False}
_lock = threading.Lock()


def freeze(*, collect: bool = False) -> int:
    """Move every object the collector tracks now into its permanent generation, after a
    full collection when ``collect`` (at a start, where a pause costs nothing); returns how
    many objects are frozen in all."""
    with _lock:
        if collect:
            gc.collect()
        gc.freeze()
        return gc.get_freeze_count()


def loaded() -> None:
    """A large long-lived object was just loaded (a tokenizer, a model): freeze it out of
    the collector, in a process that called :func:`install` (a server or a worker; a
    library user's own process is left as it is)."""
    if _state["installed"]:
        freeze()


def release() -> None:
    """A large object with reference cycles was dropped (a cache evicted it): in a process
    that called :func:`install`, give every frozen object back to the collector, collect
    (one full pause, reclaiming the dropped object) and freeze the survivors again."""
    if not _state["installed"]:
        return
    with _lock:
        gc.unfreeze()
        gc.collect()
        gc.freeze()


def installed_pause_ms() -> float | None:
    """The ``pause_ms`` :func:`install` was last called with in this process (None: never
    called; 0.0: only the named loads freeze)."""
    if not _state["installed"]:
        return None
    return float(_state["pause_ms"] or 0.0)


def install(pause_ms: float) -> None:
    """This process (and the processes it forks) freezes: the named loads
    (:func:`loaded`, :func:`release`) from now on, and a full collection that took longer
    than ``pause_ms`` milliseconds freezes what survived it (0: only the named loads).
    Calling it again changes the threshold. Raises ValueError for a negative or non-finite
    ``pause_ms`` (or one that is not a number)."""
    if isinstance(pause_ms, bool) or not isinstance(pause_ms, (int, float)) or not (
            math.isfinite(pause_ms) and pause_ms >= 0):
        raise ValueError(f"pause_ms must be a number of milliseconds >= 0, got {pause_ms!r}")
    with _lock:
        _state["installed"] = True
        _state["pause_ms"] = float(pause_ms) if pause_ms else None
        if _on_collection not in gc.callbacks:
            gc.callbacks.append(_on_collection)


def _on_collection(phase: str, info: dict[str, Any]) -> None:
    if info.get("generation") != 2:
        return
    if phase == "start":
        _state["started"] = time.perf_counter()
        return
    limit = _state["pause_ms"]
    took_ms = (time.perf_counter() - _state["started"]) * 1000
    if limit is None or took_ms <= limit:
        return
    # The collection is over (this is its "stop" callback): its survivors are long-lived.
    gc.freeze()
    if not _state["logged"]:
        _state["logged"] = True
        log.info("a full garbage collection took %.0f ms; its %d surviving objects are now "
                 "frozen out of later collections (TRAJSTORE_GC_FREEZE_AFTER_MS %g)",
                 took_ms, gc.get_freeze_count(), limit)
