"""The sweep: nothing depends on the broker being up when an episode finishes, and no episode
stays open forever when the worker that rolled it out dies."""

from __future__ import annotations

import datetime as dt
import logging
import threading
from typing import TYPE_CHECKING, Literal

from store import errors, queries
from store.eventlog import EventStore
from store.events import EpisodeFinished
from store.followers import unprojected_replays
from store.projections import Projections
from workers.replay.jobs.project import BATCH, project_episodes

if TYPE_CHECKING:
    from workers.replay.jobs.parallel import ProjectionPool

__all__ = ["abort_stale_episodes", "finish_idle_rollouts", "sweep_unprojected",
           "sweep_forever"]

log = logging.getLogger(__name__)


def _not_on_their_way(store: EventStore, limit: int) -> list[str]:
    """Up to ``limit`` finished, unprojected episodes whose replay the replay budget does not
    hold (queued, running or parked: ``workers.fair.in_hand``), after handing on the places
    of budgeted tasks that never ended (``workers.fair.release_stranded``). Without a broker
    to ask (the settings name none and the embedded one is not running, or it cannot be
    reached: logged), every unprojected episode."""
    import redis

    from store import embedded
    from workers import fair
    from workers.replay.jobs.dispatch import ticket

    settings = store.settings
    # A flooding project's parked backlog stands before any lost episode: look further.
    due = unprojected_replays(store, limit * 5)
    if not settings.redis_url and not embedded.embedded_redis_running(settings):
        return [d.episode_id for d in due[:limit]]
    try:
        fair.release_stranded(settings)
        held = fair.in_hand(settings, fair.REPLAY, [(d.project, ticket(d)) for d in due])
    except (redis.RedisError, ConnectionError) as exc:
        log.warning("sweep: the broker cannot be reached (%s); projecting every unprojected "
                    "episode", exc)
        held = set()
    return [d.episode_id for d in due if ticket(d) not in held][:limit]


def sweep_unprojected(store: EventStore, *, limit: int = 200,
                      pool: ProjectionPool | None = None, leave_budgeted: bool = False) -> int:
    """Project up to ``limit`` finished episodes that have no projection yet, oldest first,
    ``BATCH`` at a time (``project_episodes``), or on ``pool``'s processes when given.
    With ``leave_budgeted`` (the periodic sweep), only those whose replay is not on its way
    through the replay budget (:func:`_not_on_their_way`): a project's parked backlog waits
    its turn instead of being projected here, past its budget. Returns the number
    written."""
    ids = (_not_on_their_way(store, limit) if leave_budgeted
           else Projections(store).finished_unprojected(limit))
    if pool is not None:
        return sum(1 for o in pool.project(ids) if o.outcome == "written")
    written = 0
    for start in range(0, len(ids), BATCH):
        outcomes = project_episodes(store, ids[start:start + BATCH])
        written += sum(1 for o in outcomes if o.outcome == "written")
    return written


def abort_stale_episodes(store: EventStore, *, timeout_s: float, limit: int = 200,
                         now: dt.datetime | None = None) -> int:
    """Close as ``aborted`` every episode that has no ``episode_finished`` and no event for
    ``timeout_s`` seconds (by the database's clock, or as of ``now``). The append expects
    the version it saw, so an episode that got an event meanwhile is left alone (its worker
    is alive after all). Returns how many it closed. Raises ``ValueError`` for a
    non-positive timeout."""
    stale = queries.stale_episodes(store, timeout_s=timeout_s, limit=limit, now=now)
    closed = 0
    for stream_id, version in stale:
        try:
            store.append(stream_id, [EpisodeFinished(
                status="aborted", reason=f"no event for {timeout_s:g} s: its worker is gone")],
                version)
            closed += 1
        except errors.ConflictError:
            continue
    return closed


def finish_idle_rollouts(store: EventStore, *, timeout_s: float, limit: int = 200,
                         now: dt.datetime | None = None) -> int:
    """Finish every remote rollout idle for ``timeout_s`` seconds
    (``queries.idle_remote_rollouts``): the synchronous protocol revision never says that a
    rollout ended (the RolloutServer answers the trainer's ``/rollout`` call, not this
    store). ``completed`` when its last call made no tool call (the agent gave its answer),
    else ``aborted`` (the RolloutServer went away mid-turn). Like ``abort_stale_episodes``
    the append expects the version it saw. Returns how many it finished."""
    idle = queries.idle_remote_rollouts(store, timeout_s=timeout_s, limit=limit, now=now)
    closed = 0
    for stream_id, version, mid_turn in idle:
        status: Literal["aborted", "completed"] = "aborted" if mid_turn else "completed"
        reason = (f"remote rollout idle for {timeout_s:g} s "
                  f"({'with tool calls pending' if mid_turn else 'after its answer'})")
        try:
            store.append(stream_id, [EpisodeFinished(status=status, reason=reason)], version)
            closed += 1
        except errors.ConflictError:
            continue
    return closed


def sweep_forever(store: EventStore, *, interval_s: float, episode_timeout_s: float,
                  stop: threading.Event | None = None,
                  rollout_idle_timeout_s: float | None = None) -> None:
    """Finish idle remote rollouts (when ``rollout_idle_timeout_s`` is given), abort stale
    episodes and project unprojected ones whose replay is not on its way
    (``sweep_unprojected`` with ``leave_budgeted``) every ``interval_s`` seconds until
    ``stop`` is set. Transient database errors are logged and retried next round."""
    stop = stop or threading.Event()
    while not stop.is_set():
        try:
            if rollout_idle_timeout_s is not None:
                finish_idle_rollouts(store, timeout_s=rollout_idle_timeout_s)
            aborted = abort_stale_episodes(store, timeout_s=episode_timeout_s)
            written = sweep_unprojected(store, leave_budgeted=True)
            if aborted or written:
                log.info("sweep: aborted %d stale episodes, projected %d", aborted, written)
        except errors.TransientError as exc:
            log.warning("sweep: database unavailable (%s); trying again", exc)
        stop.wait(interval_s)
