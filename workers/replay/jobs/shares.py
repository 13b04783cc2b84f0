"""A project that takes more than its share of a replay process's CPU replays at a lower
CPU priority (``REPLAY_OVER_SHARE_NICE``).

The replay budget (``workers.fair``) bounds how many replays of one project are queued or
running, so a neighbour's episode waits behind at most its places; it does not bound the CPU
those replays take. A project that finishes episodes as fast as it can keeps its places busy
and, on a machine of few cores, takes the cores a neighbour's replay, the API and
PostgreSQL need. So each replay worker pool process sums the CPU time of each project's
replays over the last ``SHARE_WINDOW_S`` seconds (decayed exponentially,
``store.shares.Shares``); a project whose sum is over ``SHARE_MARGIN`` times the mean of the
projects that replayed in that window, while another project replayed within the last
second, is *over its share*, and its replays run on the process's over-share thread, whose
priority was lowered once to ``REPLAY_OVER_SHARE_NICE`` (nice 10 by default), while the
task waits for them. The kernel then gives them the CPU that work at the usual priority
leaves: a project that replays an episode now and then is
replayed first, a flooding project keeps every core the others do not want (a project alone
is never over its share), and a replay's result does not change (the same code runs, on
another thread).

Only a replay worker's pool processes do this (``workers.celery_tasks`` starts the thread
in each), for the reason ``workers.engines.niced`` gives: the caller has nothing to do but
wait. Where the priority cannot be lowered, or the setting is 0, or a replay carries no
budget (no project), the replay runs on the task's own thread, as before.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from store.settings import Settings
from store.shares import Shares
from workers.engines.niced import NicedThread

__all__ = ["SHARE_MARGIN", "SHARE_WINDOW_S", "over_share_replays",
           "over_share_thread", "replay_at_priority", "shares", "start_over_share_thread"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds over which a project's replay CPU is summed (decayed exponentially).
SHARE_WINDOW_S = 10.0
#: A project is over its share past this many times the mean of the projects' sums.
SHARE_MARGIN = 1.25

_thread: NicedThread | None = None
_lock = threading.Lock()
_ran = 0


def start_over_share_thread(settings: Settings) -> NicedThread | None:
    """Start this process's over-share thread at ``settings.replay_over_share_nice`` (once
    per process: a running one at that priority is returned). None when the setting is 0 or
    the priority cannot be lowered here (logged), and every replay then runs on its own
    thread."""
    global _thread
    nice = int(settings.replay_over_share_nice)
    with _lock:
        if nice <= 0:
            _thread = None
            return None
        if _thread is not None and _thread.usable() and _thread.nice == nice:
            return _thread
        thread = NicedThread(nice, "replay-over-share")
        if not thread.niced:
            _thread = None
            log.warning("replays of projects over their share of the replay CPU run at the "
                        "worker's priority: the over-share thread's priority could not be "
                        "lowered (%s)", thread.error)
            return None
        _thread = thread
    log.info("replays of projects over their share of the replay CPU run at nice %d on "
             "thread %d (TRAJSTORE_REPLAY_OVER_SHARE_NICE)", nice, thread.native_id)
    return thread


def over_share_thread() -> NicedThread | None:
    """This process's over-share thread, or None (not started here, or off)."""
    found = _thread
    return found if found is not None and found.usable() else None


#: This process's replay shares.
shares = Shares(SHARE_WINDOW_S, SHARE_MARGIN)


def _project(budget: Mapping[str, Any] | None) -> str | None:
    project = budget.get("project") if budget else None
    return project if isinstance(project, str) else None


def replay_at_priority(settings: Settings, budget: Mapping[str, Any] | None,
                       replay: Callable[[], T]) -> T:
    """``replay()`` on this process's lower-priority thread when its project (the
    ``budget``'s) is over its share of the process's replay CPU (``store.shares.Shares``) and
    the thread runs; else on the caller's thread. Its value or its exception either way;
    its CPU time is charged to the project. A replay without a budget (a project unknown)
    runs on the caller's thread, uncharged."""
    global _ran
    project = _project(budget)
    if project is None:
        return replay()

    def charged() -> T:
        start = time.thread_time()
        try:
            return replay()
        finally:
            shares.add(project, time.thread_time() - start)

    thread = over_share_thread()
    if thread is not None and shares.over(project):
        with _lock:
            _ran += 1
        result: T = thread.run(charged)
        return result
    return charged()


def over_share_replays() -> int:
    """How many replays this process has run on its over-share thread."""
    return _ran
