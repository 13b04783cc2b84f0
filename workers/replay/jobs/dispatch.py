"""Replay triggered by the log: every ``episode_finished``, and every late
``reward_assigned`` of a finished episode, whichever process appended it.

The replay dispatcher follows the event log in commit order (LISTEN/NOTIFY wakes it as an
append commits; polling is the fallback) and sends ``replay_episode`` for each finished
episode that has no projection at that version yet (a late reward makes a new version, so
its episode is replayed again and its samples carry the reward). It saves the log position
it acted up to in ``log_followers`` after each batch, so a restart goes on where it stopped:
an episode is sent once per finish (and late reward), and at most once more when the
process dies between a send and the save
(replay is idempotent: the second delivery does nothing). A dispatcher that starts with no
saved position reads the log from its beginning, sending only what was never projected.

Every replay worker runs a copy (``trajstore worker --queues replay``), and so does
``trajstore serve`` unless told ``--no-replay``: its copy projects each episode in its own
process (``project_here``) instead of queueing it, so an API running alone still replays what
it ingests. A PostgreSQL advisory lock lets one copy act and the others stand by, taking over
within ``standby_s`` when it goes. The periodic sweep stays as the safety net for a broker
that was down when a send was due.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from store import errors
from store.eventlog import EventStore
from store.followers import (
    REPLAY_FOLLOWER,
    leadership,
    load_cursor,
    not_projected,
    save_cursor,
)

__all__ = ["FOLLOWER", "dispatch_finished", "project_here", "send_replay", "start_dispatcher"]

log = logging.getLogger(__name__)

FOLLOWER = REPLAY_FOLLOWER


def send_replay(episode_id: str) -> None:
    """Queue ``replay_episode`` for ``episode_id`` on the configured broker."""
    from workers.app import ensure_configured

    ensure_configured().send_task("trajstore.replay_episode", args=[episode_id],
                                  queue="replay")


def project_here(store: EventStore) -> Callable[[str], None]:
    """A ``send`` that projects the episode at once in this process, on ``store``, instead
    of queueing it (``trajstore serve``'s replay). An episode that cannot be replayed is
    recorded ``invalid`` by the projection, as a replay worker records it."""
    from workers.replay.jobs.project import project_episode

    def project(episode_id: str) -> None:
        outcome = project_episode(store, episode_id)
        log.info("replayed %s: %s", episode_id, outcome.outcome)

    return project


def dispatch_finished(store: EventStore, *, send: Callable[[str], None] = send_replay,
                      stop: threading.Event, poll_interval: float = 5.0,
                      name: str = FOLLOWER) -> int:
    """Follow the log and ``send`` each finished, unprojected episode (module docstring)
    until ``stop`` is set, as long as this process leads; returns how many it sent. Returns
    at once (0) when another copy leads. A ``send`` that raises ends the call without saving
    the batch's position, so the batch is sent again by the next call."""
    sent = 0
    with leadership(store, name) as leading:
        if not leading:
            return 0
        position = load_cursor(store, name)
        for batch in store.subscribe(position, types=["episode_finished", "reward_assigned"],
                                     poll_interval=poll_interval, stop=stop):
            appended = [(r.stream_id, r.stream_version) for r in batch]
            for episode_id in not_projected(store, appended):
                send(episode_id)
                sent += 1
            save_cursor(store, name, batch[-1].log_position)
    return sent


def start_dispatcher(store_factory: Callable[[], EventStore], *, standby_s: float = 5.0,
                     poll_interval: float = 5.0,
                     send: Callable[[EventStore], Callable[[str], None]] | None = None,
                     ) -> tuple[threading.Thread, threading.Event]:
    """Run ``dispatch_finished`` in a daemon thread until the returned event is set: it
    leads when it can and stands by (trying again every ``standby_s`` seconds) when another
    copy leads; database or broker errors are logged and retried after ``standby_s``.
    ``send`` makes the action from the thread's store (default: queue ``replay_episode``;
    ``project_here``: project in this process)."""
    stop = threading.Event()

    def run() -> None:
        store: EventStore | None = None
        while not stop.is_set():
            try:
                if store is None:
                    store = store_factory()
                dispatch_finished(store, stop=stop, poll_interval=poll_interval,
                                  send=send(store) if send is not None else send_replay)
            except errors.StoreError as exc:
                log.warning("replay dispatcher: %s; trying again in %g s", exc, standby_s)
            except Exception as exc:  # the broker is down: the batch is sent again later
                log.warning("replay dispatcher could not send (%s); trying again in %g s",
                            exc, standby_s)
            stop.wait(standby_s)

    thread = threading.Thread(target=run, name="replay-dispatcher", daemon=True)
    thread.start()
    return thread, stop
