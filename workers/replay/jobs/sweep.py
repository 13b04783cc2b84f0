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


def _offer_to_the_budget(store: EventStore, limit: int) -> int | None:
    """Offer the replay budget (``workers.fair.offer``, as the replay workers' follower of
    the log does) every finished, unprojected episode among the oldest ``limit * 5`` whose
    replay the budget does not hold (queued, running or parked: ``workers.fair.in_hand``),
    after handing on the places of budgeted tasks that never ended
    (``workers.fair.release_stranded``). Each is queued on a place of its project, parked,
    or refused again when its project has ``replay_project_parked`` parked (offered again
    by the next sweep). Returns how many were queued or parked; None without a broker to
    ask (the settings name none and the embedded one is not running, or it cannot be
    reached: logged), for the caller to project them itself."""
    import redis

    from store import embedded
    from workers import fair
    from workers.replay.jobs.dispatch import REPLAY_TASK, ticket

    settings = store.settings
    if not settings.redis_url and not embedded.embedded_redis_running(settings):
        return None
    # A flooding project's parked backlog stands before any lost episode: look further.
    due = unprojected_replays(store, limit * 5)
    handed = 0
    full: set[str] = set()
    try:
        fair.release_stranded(settings)
        held = fair.in_hand(settings, fair.REPLAY, [(d.project, ticket(d)) for d in due])
        for d in due:
            if ticket(d) in held or d.project in full:
                continue
            if fair.offer(settings, fair.REPLAY, REPLAY_TASK, [d.episode_id], {},
                          project=d.project, ticket=ticket(d)) < 0:
                full.add(d.project)  # its others would be refused too
            else:
                handed += 1
    except (redis.RedisError, ConnectionError) as exc:
        log.warning("sweep: the broker cannot be reached (%s); projecting every unprojected "
                    "episode", exc)
        return None
    return handed


def sweep_unprojected(store: EventStore, *, limit: int = 200,
                      pool: ProjectionPool | None = None, leave_budgeted: bool = False) -> int:
    """Project up to ``limit`` finished episodes that have no projection yet, oldest first,
    ``BATCH`` at a time (``project_episodes``), or on ``pool``'s processes when given.
    With ``leave_budgeted`` (the periodic sweep), hand them to the replay budget instead
    when a broker answers (:func:`_offer_to_the_budget`: a lost message, an episode its
    project's full parked list refused): they are replayed on the replay workers within
    their project's places, as the follower of the log would have sent them, and the
    sweep never projects a project's backlog past its budget nor holds a replay slot
    long. Returns the number written here, or with ``leave_budgeted`` and a broker, the
    number queued or parked."""
    if leave_budgeted:
        handed = _offer_to_the_budget(store, limit)
        if handed is not None:
            return handed
    ids = Projections(store).finished_unprojected(limit)
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
    episodes and hand unprojected ones whose replay is not on its way to the replay budget
    (``sweep_unprojected`` with ``leave_budgeted``; projected here without a broker) every
    ``interval_s`` seconds until ``stop`` is set. Transient database errors are logged and
    retried next round."""
    stop = stop or threading.Event()
    while not stop.is_set():
        try:
            if rollout_idle_timeout_s is not None:
                finish_idle_rollouts(store, timeout_s=rollout_idle_timeout_s)
            aborted = abort_stale_episodes(store, timeout_s=episode_timeout_s)
            swept = sweep_unprojected(store, leave_budgeted=True)
            if aborted or swept:
                log.info("sweep: aborted %d stale episodes, replayed or queued %d", aborted,
                         swept)
        except errors.TransientError as exc:
            log.warning("sweep: database unavailable (%s); trying again", exc)
        stop.wait(interval_s)
