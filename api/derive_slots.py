"""Dataset derivations over REST as a budgeted, shared resource of one API process.

A derivation replays every episode of its runs: seconds to minutes of CPU, more with a run
whose chat template renders slowly. ``DeriveSlots`` keeps one project from holding that
resource against the others:

- each derivation replays its episodes on a derivation process of its own, out of
  ``api_derive_processes`` (started on first use and kept, so their tokenizers and
  connections stay warm), not in the API's interpreter: the request's thread only waits, and
  the other requests keep the interpreter;
- a project runs at most ``api_derive_project_running`` derivations at once (one by
  default). With two processes or more (two by default) a project therefore never holds
  them all, and another project's derivation finds a free process, whatever the first one
  replays and however long it takes;
- a derivation over either limit is answered 429 naming the setting, before anything is
  read; nothing is queued.

0 processes replays in the request's own thread (the project limit still holds).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from api.errors import ApiError
from workers.datasets import DerivePool

__all__ = ["DeriveSlots"]


class DeriveSlots:
    """The REST derivations of one API process (module docstring). ``slot(project)`` is
    entered around a derivation and yields the pool of one process to replay on (None: in
    this thread)."""

    def __init__(self, database_url: str, *, per_project: int, processes: int) -> None:
        self.database_url = database_url
        self.per_project = per_project
        self.processes = processes
        self._lock = threading.Lock()
        self._running: dict[str, int] = {}
        self._free: list[DerivePool] = []
        self._started = 0
        self._closed = False

    def running(self, project: str) -> int:
        """Derivations of ``project`` running now."""
        with self._lock:
            return self._running.get(project, 0)

    @contextmanager
    def slot(self, project: str) -> Iterator[DerivePool | None]:
        """Hold one of ``project``'s derivation places and a derivation process for the
        block; ApiError 429 naming ``TRAJSTORE_API_DERIVE_PROJECT_RUNNING`` when the project
        holds all its places, or ``TRAJSTORE_API_DERIVE_PROCESSES`` when every process
        derives for another project."""
        with self._lock:
            running = self._running.get(project, 0)
            if running >= self.per_project:
                raise ApiError(
                    429, "too_many_requests",
                    f"project {project!r} has {running} dataset derivation(s) running in this "
                    f"API process already (TRAJSTORE_API_DERIVE_PROJECT_RUNNING="
                    f"{self.per_project}); retry when one has answered, or derive large "
                    f"datasets with `trajstore dataset derive --jobs N`",
                    headers={"Retry-After": "5"}, refused_by_limit=True)
            pool: DerivePool | None = None
            if self.processes > 0:
                if self._free:
                    pool = self._free.pop()
                elif self._started < self.processes:
                    self._started += 1
                    pool = DerivePool(self.database_url, jobs=1)
                else:
                    raise ApiError(
                        429, "too_many_requests",
                        f"all {self.processes} dataset derivation processes of this API "
                        f"process are deriving for other projects (TRAJSTORE_API_DERIVE_"
                        f"PROCESSES={self.processes}); retry when one has answered",
                        headers={"Retry-After": "5"}, refused_by_limit=True)
            self._running[project] = running + 1
        try:
            yield pool
        finally:
            with self._lock:
                left = self._running[project] - 1
                if left:
                    self._running[project] = left
                else:
                    del self._running[project]
                if pool is not None and not self._closed:
                    self._free.append(pool)
                    pool = None
            if pool is not None:  # closed meanwhile
                pool.close()

    def close(self) -> None:
        """Stop the idle derivation processes, and each busy one when its derivation
        ends."""
        with self._lock:
            self._closed = True
            idle, self._free = self._free, []
        for pool in idle:
            pool.close()
