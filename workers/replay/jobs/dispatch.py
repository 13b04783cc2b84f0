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
process (:func:`replay_here`) instead of queueing it, so an API running alone still replays
what it ingests. A PostgreSQL advisory lock lets one copy act and the others stand by, taking over
within ``standby_s`` when it goes. The periodic sweep stays as the safety net for a broker
that was down when a send was due.

Each replay is queued within its project's replay budget (:mod:`workers.fair`,
``replay_project_running``): the dispatcher takes one of the project's places before it
sends the task, and parks it in Redis instead when the project has all its places taken; a
replay that ends hands its place to the project's oldest parked one, queued again at the
queue's tail. So a project that finishes thousands of episodes at once has at most
``replay_project_running`` replays queued or running, and another project's episode waits
behind that many of them at most. The dispatcher knows each episode's project from the same
query that finds which episodes are due (:func:`store.followers.due_replays`). A replay's
ticket is its episode and the version that made it due, so a batch sent again after the
dispatcher died finds its replays parked or placed already and parks nothing twice.

``trajstore serve``'s own replay (:func:`replay_here`) keeps no budget in Redis (an API
running alone may have no broker) but is fair the same way, inside the process
(:mod:`workers.replay.jobs.inprocess`): the follower puts each due episode on its project's
queue in the process and goes on reading the log, and one replay thread projects a replay of
each project in turn, so another project's episode waits behind at most one replay of each
project, not behind a neighbour's whole backlog in log order. A project's queue holds at most
``replay_project_parked`` replays; past it an episode is refused and left to a later pass of
that replay over PostgreSQL's finished, unprojected episodes. The follower still saves its
position after each batch, once the batch is handed to the queues, not once it is projected;
what was queued and not yet projected when the process died is found by the pass the
in-process replay makes each time its follower starts to lead (``trajstore serve`` runs no
sweep: the in-process replay is its own), and, in a deployment with replay workers, by their
sweep.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from store import errors
from store.eventlog import EventStore
from store.followers import (
    REPLAY_FOLLOWER,
    ReplayDue,
    due_replays,
    leadership,
    load_cursor,
    save_cursor,
)
from store.settings import Settings
from workers.replay.jobs.inprocess import InProcessReplay

__all__ = ["FOLLOWER", "REPLAY_TASK", "dispatch_finished", "queue_replay", "replay_here",
           "start_dispatcher", "ticket"]

log = logging.getLogger(__name__)

FOLLOWER = REPLAY_FOLLOWER

#: The Celery task that projects one episode (``workers.celery_tasks.replay_episode``).
REPLAY_TASK = "trajstore.replay_episode"


def ticket(due: ReplayDue) -> str:
    """The budget ticket of ``due``'s replay: its episode and the version that made it due
    (the same for every send of that replay, so Redis holds it once)."""
    return f"{due.episode_id}@{due.version}"


def queue_replay(settings: Settings) -> Callable[[ReplayDue], None]:
    """A ``send`` that queues ``replay_episode`` on the broker the settings name, within the
    episode's project's replay budget (module docstring): queued on a place, or parked.
    Raises ConnectionError naming the broker when it cannot be reached."""
    from workers import fair

    def send(due: ReplayDue) -> None:
        fair.send(settings, fair.REPLAY, REPLAY_TASK, [due.episode_id], {},
                  project=due.project, ticket=ticket(due))

    return send


def replay_here(store_factory: Callable[[], EventStore], settings: Settings, *,
                standby_s: float = 5.0, poll_interval: float = 5.0,
                ) -> tuple[InProcessReplay, threading.Thread, threading.Event]:
    """``trajstore serve``'s replay: a copy of the follower (:func:`start_dispatcher`) that
    hands each due episode to an :class:`~workers.replay.jobs.inprocess.InProcessReplay`,
    whose one thread projects them in this process, a replay of each project in turn, at
    most ``replay_project_parked`` queued per project (module docstring). Returns the
    replay, the follower's thread and the event that stops the follower
    (``InProcessReplay.stop`` stops the replay). An episode that cannot be replayed is
    recorded ``invalid`` by the projection, as a replay worker records it."""
    from workers.replay.jobs.project import fault_delay

    replay = InProcessReplay(store_factory, cap=settings.replay_project_parked,
                             retry_s=standby_s, before_commit=fault_delay(settings))
    replay.start()
    thread, stop = start_dispatcher(store_factory, standby_s=standby_s,
                                    poll_interval=poll_interval, send=replay.send,
                                    on_lead=replay.leading)
    return replay, thread, stop


def dispatch_finished(store: EventStore, *, send: Callable[[ReplayDue], None] | None = None,
                      stop: threading.Event, poll_interval: float = 5.0,
                      name: str = FOLLOWER, on_lead: Callable[[], None] | None = None) -> int:
    """Follow the log and ``send`` each finished, unprojected episode (module docstring;
    default: :func:`queue_replay` on the store's settings) until ``stop`` is set, as long
    as this process leads; returns how many it sent (queued or parked). Returns at once (0)
    when another copy leads. ``on_lead`` is called once this call leads, before it reads
    the log. A ``send`` that raises ends the call without saving the batch's position, so
    the batch is sent again by the next call."""
    if send is None:
        send = queue_replay(store.settings)
    sent = 0
    with leadership(store, name) as leading:
        if not leading:
            return 0
        if on_lead is not None:
            on_lead()
        position = load_cursor(store, name)
        for batch in store.subscribe(position, types=["episode_finished", "reward_assigned"],
                                     poll_interval=poll_interval, stop=stop):
            appended = [(r.stream_id, r.stream_version) for r in batch]
            for due in due_replays(store, appended):
                send(due)
                sent += 1
            save_cursor(store, name, batch[-1].log_position)
    return sent


def start_dispatcher(store_factory: Callable[[], EventStore], *, standby_s: float = 5.0,
                     poll_interval: float = 5.0,
                     send: Callable[[EventStore], Callable[[ReplayDue], None]] | None = None,
                     on_lead: Callable[[], None] | None = None,
                     ) -> tuple[threading.Thread, threading.Event]:
    """Run ``dispatch_finished`` in a daemon thread until the returned event is set: it
    leads when it can and stands by (trying again every ``standby_s`` seconds) when another
    copy leads; database or broker errors are logged and retried after ``standby_s``.
    ``send`` makes the action from the thread's store (default: :func:`queue_replay` on its
    settings; :func:`replay_here` passes its in-process replay's), ``on_lead`` is called
    each time the thread starts to lead."""
    stop = threading.Event()

    def run() -> None:
        store: EventStore | None = None
        while not stop.is_set():
            try:
                if store is None:
                    store = store_factory()
                dispatch_finished(store, stop=stop, poll_interval=poll_interval,
                                  send=send(store) if send is not None else None,
                                  on_lead=on_lead)
            except errors.StoreError as exc:
                log.warning("replay dispatcher: %s; trying again in %g s", exc, standby_s)
            except Exception as exc:  # the broker is down: the batch is sent again later
                log.warning("replay dispatcher could not send (%s); trying again in %g s",
                            exc, standby_s)
            stop.wait(standby_s)

    thread = threading.Thread(target=run, name="replay-dispatcher", daemon=True)
    thread.start()
    return thread, stop
