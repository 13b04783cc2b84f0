"""Which project a run, an episode or a lease belongs to, and whether a key may touch it.

A key sees only its own project: touching another project's run, episode or lease is a 403
(an unknown one a 404). The owners never change once written (a run's project is in its
``run_created`` event, an episode's run in its ``episode_started``), so they are cached
per process.
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict

from api.errors import ApiError
from api.keys import ApiKey
from store import queries
from store.eventlog import EventStore

__all__ = ["Access"]

_CACHE_SIZE = 100_000


class _Lru:
    def __init__(self) -> None:
        self._items: OrderedDict[object, str] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: object) -> str | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: object, value: str) -> None:
        with self._lock:
            self._items[key] = value
            while len(self._items) > _CACHE_SIZE:
                self._items.popitem(last=False)


class Access:
    """Ownership lookups and project checks over one store."""

    def __init__(self, store: EventStore) -> None:
        self.store = store
        self._run_project = _Lru()
        self._episode_run = _Lru()
        self._lease_run = _Lru()

    def run_project(self, run_id: str) -> str:
        """The project of ``run_id``; ApiError 404 when there is no such run."""
        project = self._run_project.get(run_id)
        if project is None:
            record = queries.run_record(self.store, run_id)
            if record is None:
                raise ApiError(404, "not_found", f"no run {run_id!r}")
            project = str(record["data"].get("project") or "default")
            self._run_project.put(run_id, project)
        return project

    def episode_run(self, episode_id: str) -> str:
        """The run of ``episode_id``; ApiError 404 when there is no such episode."""
        run_id = self._episode_run.get(episode_id)
        if run_id is None:
            run_id = queries.episode_run(self.store, episode_id)
            if run_id is None:
                raise ApiError(404, "not_found", f"no episode {episode_id!r}")
            self._episode_run.put(episode_id, run_id)
        return run_id

    def check_run(self, key: ApiKey, run_id: str) -> None:
        """ApiError 404 for an unknown run, 403 when it is not the key's project's."""
        if self.run_project(run_id) != key.project:
            raise ApiError(403, "forbidden",
                           f"run {run_id!r} is not in this key's project {key.project!r}")

    def check_episode(self, key: ApiKey, episode_id: str) -> str:
        """The episode's run, after the checks of ``check_run`` (404 for an unknown
        episode)."""
        run_id = self.episode_run(episode_id)
        if self.run_project(run_id) != key.project:
            raise ApiError(403, "forbidden", f"episode {episode_id!r} is not in this key's "
                                             f"project {key.project!r}")
        return run_id

    @staticmethod
    def check_scope(key: ApiKey, episode_id: str | None) -> None:
        """ApiError 403 when ``key`` is the credential of one episode
        (``ApiKey.episode_id``) and ``episode_id`` is another one, or none."""
        if key.episode_id is not None and episode_id != key.episode_id:
            named = "no episode" if episode_id is None else f"episode {episode_id[:60]!r}"
            raise ApiError(403, "forbidden", f"this credential may record only episode "
                                             f"{key.episode_id!r}, not {named}")

    def check_lease(self, key: ApiKey, lease_id: uuid.UUID) -> str:
        """The lease's run, after the checks of ``check_run`` (404 for an unknown lease)."""
        run_id = self._lease_run.get(lease_id)
        if run_id is None:
            run_id = queries.lease_run(self.store, lease_id)
            if run_id is None:
                raise ApiError(404, "not_found", f"no lease {lease_id}")
            self._lease_run.put(lease_id, run_id)
        if self.run_project(run_id) != key.project:
            raise ApiError(403, "forbidden",
                           f"lease {lease_id} is not in this key's project {key.project!r}")
        return run_id
