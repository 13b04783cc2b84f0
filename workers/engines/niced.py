"""A thread of the process at a lower CPU priority that runs calls for callers that wait.

Linux gives each thread a nice value of its own (``setpriority(PRIO_PROCESS, tid, n)``), so
one thread of a process can run at a lower priority than the others. A caller hands a
function to :meth:`NicedThread.run` and waits for its value; the function runs on the niced
thread, so the kernel gives it only the CPU that work at a higher priority (the other
projects' replays, the API, PostgreSQL) leaves.

Use it only where the caller has nothing else to do while it waits: a replay worker's pool
process. A niced thread that holds the interpreter lock while the kernel leaves it off the
CPU stalls every other thread of the process behind it (priority inversion), so a process
that serves requests on threads (the API) must never run one.

Lowering a thread's priority needs no privilege; raising it back would, so the thread keeps
its priority for good and a process keeps one such thread per priority. The thread does not
survive a fork: a child starts its own.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["NicedThread"]


class _Job:
    __slots__ = ("call", "done", "error", "result")

    def __init__(self, call: Callable[[], Any]) -> None:
        self.call = call
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


class NicedThread:
    """A daemon thread at ``nice`` (1 to 19) that runs one call at a time for callers that
    wait for it (:meth:`run`). ``niced`` tells whether the priority could be lowered (False
    where it cannot: not Linux, not permitted; ``error`` then says why, and the thread has
    stopped). Raises ValueError for a ``nice`` outside 1..19."""

    def __init__(self, nice: int, name: str) -> None:
        if isinstance(nice, bool) or not isinstance(nice, int) or not 1 <= nice <= 19:
            raise ValueError(f"nice must be an integer from 1 to 19, got {nice!r}")
        self.nice = nice
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._ready = threading.Event()
        self.pid = os.getpid()
        #: The thread's id for the kernel (what ``os.getpriority`` takes), once it runs.
        self.native_id = 0
        self.niced = False
        self.error = ""
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()
        self._ready.wait()

    def _run(self) -> None:
        self.native_id = threading.get_native_id()
        try:
            os.setpriority(os.PRIO_PROCESS, self.native_id, self.nice)
            # At least as low as asked: a process already at a lower priority keeps it.
            self.niced = os.getpriority(os.PRIO_PROCESS, self.native_id) >= self.nice
            if not self.niced:
                self.error = "its priority did not change"
        except (AttributeError, OSError) as exc:  # not Linux, or not permitted
            self.error = f"{type(exc).__name__}: {exc}"
        self._ready.set()
        if not self.niced:
            return
        while True:
            job = self._jobs.get()
            try:
                job.result = job.call()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller as it is
                job.error = exc
            finally:
                job.done.set()
            del job

    def usable(self) -> bool:
        """Whether the thread can take a call: it runs, in this process (not a fork's
        copy of a parent's, which has no thread behind it)."""
        return self.pid == os.getpid() and self.thread.is_alive()

    def run(self, call: Callable[[], Any]) -> Any:
        """``call()`` on the niced thread; its value, or its exception raised here
        (RuntimeError if the thread stopped before it answered, or never started)."""
        if not self.usable():
            raise RuntimeError(f"the niced thread {self.thread.name!r} does not run in this "
                               "process")
        job = _Job(call)
        self._jobs.put(job)
        # Waiting releases the interpreter lock while the call runs.
        while not job.done.wait(1.0):
            if not self.thread.is_alive():
                raise RuntimeError(f"the niced thread {self.thread.name!r} stopped")
        if job.error is not None:
            try:
                raise job.error
            finally:
                job.error = None
        return job.result
