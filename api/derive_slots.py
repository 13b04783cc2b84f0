"""Dataset derivations over REST as a budgeted, shared resource of one API process.

A derivation replays every episode of its runs: seconds to minutes of CPU, more with a run
whose chat template renders slowly. ``DeriveSlots`` keeps one project from holding that
resource against the others:

- each derivation replays its episodes on a derivation process of its own, out of
  ``api_derive_processes`` (started on first use and kept, so their tokenizers and
  connections stay warm), not in the API's interpreter: the request's thread only waits, and
  the other requests keep the interpreter;
- a project runs at most ``api_derive_project_running`` derivations at once (one by
  default), counted by the :class:`~api.places.ProjectPlaces` it is given (as exports and
  OTLP exports are). With two processes or more (two by default) a project therefore never
  holds them all, and another project's derivation finds a free process, whatever the first
  one replays and however long it takes;
- a derivation over either limit is answered 429 naming the setting, before anything is
  read; nothing is queued.

0 processes replays in the request's own thread (the project limit still holds).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from api.errors import ApiError
from api.places import ProjectPlaces
from workers.datasets import DerivePool

__all__ = ["DeriveSlots", "derive_places"]


def derive_places() -> ProjectPlaces:
    """The places of REST derivations in one API process: 429 naming
    ``TRAJSTORE_API_DERIVE_PROJECT_RUNNING`` past them."""
    return ProjectPlaces("dataset derivation(s)", "TRAJSTORE_API_DERIVE_PROJECT_RUNNING",
                         retry_after_s=5, advice="retry when one has answered, or derive "
                         "large datasets with `trajstore dataset derive --jobs N`")


class DeriveSlots:
    """The REST derivations of one API process (module docstring): ``places`` counts each
    project's, at most ``per_project``; this keeps the ``processes`` derivation processes.
    ``slot(project)`` is entered around a derivation and yields the pool of one process to
    replay on (None: in this thread)."""

    def __init__(self, database_url: str, *, places: ProjectPlaces, per_project: int,
                 processes: int) -> None:
        self.database_url = database_url
        self.places = places
        self.per_project = per_project
        self.processes = processes
        self._lock = threading.Lock()
        self._free: list[DerivePool] = []
        self._started = 0
        self._closed = False

    def running(self, project: str) -> int:
        """Derivations of ``project`` running now."""
        return self.places.running(project)

    @contextmanager
    def slot(self, project: str) -> Iterator[DerivePool | None]:
        """Hold one of ``project``'s derivation places and a derivation process for the
        block; ApiError 429 naming ``TRAJSTORE_API_DERIVE_PROJECT_RUNNING`` when the project
        holds all its places, or ``TRAJSTORE_API_DERIVE_PROCESSES`` when every process
        derives for another project (the place is given back)."""
        give_back = self.places.take(project, self.per_project)
        try:
            pool = self._take_process()
        except BaseException:
            give_back()
            raise
        try:
            yield pool
        finally:
            give_back()
            if pool is not None:
                self._give_back_process(pool)

    def _take_process(self) -> DerivePool | None:
        if self.processes <= 0:
            return None
        with self._lock:
            if self._free:
                return self._free.pop()
            if self._started < self.processes:
                self._started += 1
                return DerivePool(self.database_url, jobs=1)
        raise ApiError(
            429, "too_many_requests",
            f"all {self.processes} dataset derivation processes of this API process are "
            f"deriving for other projects (TRAJSTORE_API_DERIVE_PROCESSES={self.processes}); "
            f"retry when one has answered", headers={"Retry-After": "5"},
            refused_by_limit=True)

    def _give_back_process(self, pool: DerivePool) -> None:
        with self._lock:
            if not self._closed:
                self._free.append(pool)
                return
        pool.close()  # closed meanwhile

    def close(self) -> None:
        """Stop the idle derivation processes, and each busy one when its derivation
        ends."""
        with self._lock:
            self._closed = True
            idle, self._free = self._free, []
        for pool in idle:
            pool.close()
