"""Places per project: a bounded number of requests of one kind in progress at once for each
project in one API process (``ProjectPlaces``), for the requests that hold a thread or a child
process for long (OTLP exports being decoded, exports being streamed, datasets being
derived)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from api.errors import ApiError

__all__ = ["Held", "ProjectPlaces"]


class ProjectPlaces:
    """How many requests of one kind (``what``: "OTLP export(s)") each project has in
    progress in one API process, at most ``limit`` (the value of ``setting``) at once: one
    more is answered 429 naming the setting, with ``Retry-After``. A project flooding such
    requests then holds at most that many of the process's threads (or child processes) for
    them, and another project's request finds one free. ``advice`` ends the refusal's
    message (default: retry after one answers)."""

    def __init__(self, what: str, setting: str, *, retry_after_s: int = 1,
                 advice: str = "retry after one answers") -> None:
        self.what = what
        self.setting = setting
        self.retry_after_s = retry_after_s
        self.advice = advice
        self._lock = threading.Lock()
        self._running: Counter[str] = Counter()

    def running(self, project: str) -> int:
        """The requests of ``project`` in progress now."""
        with self._lock:
            return self._running[project]

    def take(self, project: str, limit: int) -> Callable[[], None]:
        """Take one of ``project``'s ``limit`` places and return what gives it back (once,
        however often it is called); ApiError 429 when all are taken."""
        with self._lock:
            if self._running[project] >= limit:
                raise ApiError(
                    429, "too_many_requests",
                    f"project {project!r} has {limit} {self.what} in progress in this API "
                    f"process already, the limit ({self.setting}={limit}); {self.advice}",
                    headers={"Retry-After": str(self.retry_after_s)}, refused_by_limit=True)
            self._running[project] += 1
        given_back = False

        def give_back() -> None:
            nonlocal given_back
            with self._lock:
                if given_back:
                    return
                given_back = True
                self._running[project] -= 1
                if not self._running[project]:
                    del self._running[project]
        return give_back

    @contextmanager
    def enter(self, project: str, limit: int) -> Iterator[None]:
        """Hold one of ``project``'s ``limit`` places for the block (``take``)."""
        give_back = self.take(project, limit)
        try:
            yield
        finally:
            give_back()


class Held:
    """``chunks`` (a streamed answer's body) holding a place until it is exhausted, fails,
    is closed, or is dropped unread (a client gone before the answer started): then
    ``give_back`` is called, once."""

    def __init__(self, chunks: Iterator[bytes], give_back: Callable[[], None]) -> None:
        self._chunks = chunks
        self._give_back = give_back

    def __iter__(self) -> Held:
        return self

    def __next__(self) -> bytes:
        try:
            return next(self._chunks)
        except BaseException:  # StopIteration included: the place is free once it ends
            self.close()
            raise

    def close(self) -> None:
        """Give the place back and close ``chunks``."""
        self._give_back()
        close = getattr(self._chunks, "close", None)
        if close is not None:
            close()

    def __del__(self) -> None:
        self._give_back()
