"""Engine ids: the name a generation engine goes by in ``policy_served`` reports.

A rollout worker's engine and the trainer's in-process engine both report which policy
version they took up (:mod:`store.serving`); :func:`engine_id` is the one rule for what they
call themselves.
"""

from __future__ import annotations

import os
import socket
import threading
import weakref

__all__ = ["engine_id"]

_ids_lock = threading.Lock()
_numbers: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()
_counts: dict[str, int] = {}


def engine_id(backend: object) -> str:
    """A stable id of a generation engine for ``policy_served`` reports: the backend's own
    ``engine_id`` string when it has one (a remote server names itself), else
    ``<host>:<pid>/<backend class>``, with ``#2``, ``#3``... for the second, third... backend
    of that class in the process; the same for as long as the backend lives."""
    own = getattr(backend, "engine_id", None)
    if isinstance(own, str) and own:
        return own
    name = type(backend).__name__
    with _ids_lock:
        number = _numbers.get(backend)
        if number is None:
            number = _numbers[backend] = _counts[name] = _counts.get(name, 0) + 1
    suffix = f"#{number}" if number > 1 else ""
    return f"{socket.gethostname()}:{os.getpid()}/{name}{suffix}"
