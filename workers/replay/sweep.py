"""The sweep: nothing depends on the broker being up when an episode finishes."""

from __future__ import annotations

from store.eventlog import EventStore
from store.projections import Projections
from workers.replay.project import project_episode

__all__ = ["sweep_unprojected"]


def sweep_unprojected(store: EventStore, *, limit: int = 200) -> int:
    """Project up to ``limit`` finished episodes that have no projection yet, oldest first.
    Returns the number written."""
    written = 0
    for episode_id in Projections(store).finished_unprojected(limit):
        if project_episode(store, episode_id).outcome == "written":
            written += 1
    return written
