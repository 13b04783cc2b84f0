"""``trajstore serve``'s own replay: the episodes its copy of the replay follower finds due,
projected in the serving process on one thread, fairly between projects.

The follower (:func:`workers.replay.jobs.dispatch.dispatch_finished`) hands each due replay
to :meth:`InProcessReplay.offer`, which puts it on its project's queue and returns at once;
the replay thread takes the projects in turn, one replay each (round robin), so another
project's episode waits behind at most one replay of each project ahead of it in the turn (the
one running when it arrived included), however many episodes a project finished before it,
and however long each of them renders (up to ``RENDER_BUDGET_S``). Within a project, replays
keep the order the follower found them in. One thread does every replay: the API's
interpreter is shared with the request threads, and a second replay thread would take their
time, not add any.

A project's queue holds at most ``cap`` replays (``replay_project_parked``, as the replay
workers' budget parks at most that many in Redis). An episode offered past it is *refused*:
nothing is kept of it, and a later *pass* finds it in PostgreSQL. A pass reads every finished,
unprojected episode (:func:`store.followers.unprojected_page`, page by page) and offers each
again; it runs

- when the follower starts to lead (:meth:`InProcessReplay.leading`): the follower saves its
  position in the log once it has handed a batch over, not once it is projected, so the
  episodes queued here when the process died are found by the next leader's pass
  (``trajstore serve`` runs no sweep);
- when every project refused since the last pass has an empty queue (the pass then refills
  them oldest first, up to ``cap`` each; a project refused again waits for the next);
- ``retry_s`` after a replay failed (the episode is found again then). An episode whose
  replay keeps failing (an error that is not transient) is offered again after ``retry_s``,
  then twice that, doubling up to ``MAX_BACKOFF_S``: the passes skip it until then, unless a
  new version of it (a late reward) is due.

A replay that meets a transient database error goes back to the head of its queue and the
thread waits ``retry_s``. Replays are idempotent, so an episode offered twice (by the follower
and by a pass) is written once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from store import errors
from store.eventlog import EventStore
from store.followers import ReplayDue, unprojected_page

__all__ = ["InProcessReplay", "PAGE"]

log = logging.getLogger(__name__)

#: Finished, unprojected episodes a pass reads per query.
PAGE = 500

#: The longest wait before a replay that keeps failing is tried again (seconds).
MAX_BACKOFF_S = 300.0


class InProcessReplay:
    """Per-project queues of due replays and the one thread that projects them in turn
    (module docstring). ``store_factory`` opens the thread's store (on its first need);
    ``cap`` bounds each project's queue; ``retry_s`` is the wait after a failure;
    ``before_commit`` runs inside each replay's transaction (fault injection for tests).
    ValueError for a ``cap`` below 1 or a negative ``retry_s``."""

    def __init__(self, store_factory: Callable[[], EventStore], *, cap: int,
                 retry_s: float = 5.0, before_commit: Callable[[], None] | None = None) -> None:
        if cap < 1:
            raise ValueError(f"a project's replay queue holds at least one episode, got "
                             f"cap={cap}")
        if retry_s < 0:
            raise ValueError(f"retry_s is a wait in seconds, at least 0, got {retry_s}")
        self._store_factory = store_factory
        self._cap = cap
        self._retry_s = retry_s
        self._before_commit = before_commit
        self._cond = threading.Condition()
        self._queues: dict[str, OrderedDict[str, ReplayDue]] = {}
        self._turn: deque[str] = deque()  # projects with queued replays, next first
        self._running: str | None = None  # the project of the replay in progress
        self._refused: set[str] = set()  # projects refused since the last pass
        # episode -> (failures in a row, not offered again before (monotonic), its version)
        self._failing: dict[str, tuple[int, float, int]] = {}
        self._pass_at: float | None = None  # when a pass is due (monotonic), None: none
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- what the follower calls ------------------------------------------------------------

    def send(self, _store: EventStore) -> Callable[[ReplayDue], None]:
        """The follower's ``send`` (``start_dispatcher``'s ``send`` takes the follower's store
        and gives the action): :meth:`offer`."""

        def offer(due: ReplayDue) -> None:
            self.offer(due)

        return offer

    def offer(self, due: ReplayDue) -> bool:
        """Queue ``due`` on its project's queue: True when it is queued (or was already:
        queued once per episode), False when it is refused (the project has ``cap``
        queued; a later pass finds it)."""
        with self._cond:
            failing = self._failing.get(due.episode_id)
            if failing is not None and due.version <= failing[2] \
                    and time.monotonic() < failing[1]:
                return True  # failing: a pass offers it again when its wait is over
            queue = self._queues.setdefault(due.project, OrderedDict())
            if due.episode_id in queue:
                return True
            if len(queue) >= self._cap:
                self._refused.add(due.project)
                return False
            queue[due.episode_id] = due
            if len(queue) == 1 and due.project != self._running:
                self._turn.append(due.project)
            self._cond.notify()
            return True

    def leading(self) -> None:
        """The follower leads now: a pass is due at once (module docstring)."""
        self._want_pass(0.0)

    # --- the thread -------------------------------------------------------------------------

    def start(self) -> InProcessReplay:
        """Start the replay thread (a daemon); returns self. RuntimeError when started
        already."""
        if self._thread is not None:
            raise RuntimeError("this in-process replay is started already")
        self._thread = threading.Thread(target=self._run, name="replay-here", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Stop the replay thread after the replay in progress (what is queued is left to the
        next leader's pass)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def queued(self) -> dict[str, int]:
        """How many replays each project has queued now (projects with none left out)."""
        with self._cond:
            return {p: len(q) for p, q in self._queues.items() if q}

    def _want_pass(self, after_s: float) -> None:
        with self._cond:
            at = time.monotonic() + after_s
            self._pass_at = at if self._pass_at is None else min(self._pass_at, at)
            self._cond.notify()

    def _pass_due(self, now: float) -> bool:
        """Whether a pass runs now (caller holds the lock): one was asked for, or a refused
        project's queue has drained."""
        if self._refused and all(not self._queues.get(p) for p in self._refused):
            return True
        return self._pass_at is not None and self._pass_at <= now

    def _next(self) -> tuple[str, ReplayDue | None]:
        """Wait for the next thing to do: ``("pass", None)``, ``("replay", due)`` (the next
        project's oldest replay, its project now running) or ``("stop", None)``."""
        with self._cond:
            while not self._stop.is_set():
                now = time.monotonic()
                if self._pass_due(now):
                    return "pass", None
                if self._turn:
                    project = self._turn.popleft()
                    _, due = self._queues[project].popitem(last=False)
                    self._running = project
                    return "replay", due
                wait = None if self._pass_at is None else max(0.0, self._pass_at - now)
                self._cond.wait(wait)
            return "stop", None

    def _done(self, project: str, *, again: ReplayDue | None = None) -> None:
        """The replay of ``project`` ended: ``again`` goes back to the head of its queue; the
        project takes its place at the end of the turn when it has more queued."""
        with self._cond:
            queue = self._queues[project]
            if again is not None and again.episode_id not in queue:
                queue[again.episode_id] = again
                queue.move_to_end(again.episode_id, last=False)
            self._running = None
            if queue:
                self._turn.append(project)
            else:
                del self._queues[project]

    def _run(self) -> None:
        store: EventStore | None = None
        while True:
            what, due = self._next()
            if what == "stop":
                break
            try:
                if store is None:
                    store = self._store_factory()
            except Exception as exc:
                if due is not None:
                    self._done(due.project, again=due)
                else:
                    self._want_pass(self._retry_s)
                log.warning("in-process replay cannot open the store (%s); trying again in "
                            "%g s", exc, self._retry_s)
                self._stop.wait(self._retry_s)
                continue
            if due is not None:
                self._replay(store, due)
                continue
            try:
                self._catch_up(store)
            except Exception as exc:
                log.warning("in-process replay: a pass failed (%s); trying again in %g s",
                            exc, self._retry_s)
                self._want_pass(self._retry_s)
                self._stop.wait(self._retry_s)
        if store is not None:
            store.close()

    def _replay(self, store: EventStore, due: ReplayDue) -> None:
        from workers.replay.jobs.project import project_episode

        try:
            outcome = project_episode(store, due.episode_id, before_commit=self._before_commit)
        except errors.TransientError as exc:
            self._done(due.project, again=due)
            log.warning("in-process replay of %s: %s; trying again in %g s", due.episode_id,
                        exc, self._retry_s)
            self._stop.wait(self._retry_s)
            return
        except Exception:
            with self._cond:
                failures = self._failing.get(due.episode_id, (0, 0.0, 0))[0] + 1
                wait = min(self._retry_s * 2 ** (failures - 1), MAX_BACKOFF_S)
                self._failing[due.episode_id] = (failures, time.monotonic() + wait,
                                                 due.version)
            self._done(due.project)
            log.exception("in-process replay of %s failed (%d time(s) in a row); it is "
                          "looked for again in %g s", due.episode_id, failures, wait)
            self._want_pass(wait)
            return
        with self._cond:
            self._failing.pop(due.episode_id, None)
        self._done(due.project)
        log.info("replayed %s: %s", due.episode_id, outcome.outcome)

    def failing(self) -> dict[str, int]:
        """The episodes whose replay failed, and how many times in a row (those that
        replayed since are left out)."""
        with self._cond:
            return {e: n for e, (n, _, _) in self._failing.items()}

    def _catch_up(self, store: EventStore) -> None:
        """A pass: offer every finished, unprojected episode (module docstring)."""
        with self._cond:
            self._refused.clear()
            self._pass_at = None
        after: int | None = None
        offered = refused = 0
        while not self._stop.is_set():
            page, after = unprojected_page(store, PAGE, after=after)
            for due in page:
                if self.offer(due):
                    offered += 1
                else:
                    refused += 1
            if after is None:
                break
        if offered or refused:
            log.info("in-process replay: a pass found %d unprojected episodes (%d left to "
                     "the next pass: their project's queue is full)", offered + refused,
                     refused)
