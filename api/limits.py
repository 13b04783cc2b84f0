"""The request size limit, the refusal budget, the fair share and the URL check.

The request size limit: a body over ``api_max_request_bytes`` is answered 413 before
any route sees it (a declared ``Content-Length`` over the limit is refused unread; a chunked
body is counted as it arrives and refused as soon as it passes the limit). And the URL check:
a NUL character in the path or in a query parameter is answered 422 naming it, before any
route passes it to the database (whose text cannot hold NUL).

The refusal budget (``RefusalBudget``): a project whose requests were refused by a limit
(413, 429, a 422 of a limit: ``limit_exceeded``, ``render_budget``, a tokenizer folder outside
the roots) ``api_refusal_budget`` times within the last ``api_refusal_window_s`` seconds is
answered 429 at once, its body unread, until the oldest of those refusals is older than the
window (said in Retry-After). That answer is held up to ``HOLD_S`` (at most ``MAX_HELD`` at
once), so that a client ignoring Retry-After is not answered in a tight loop. A project
flooding requests that a limit refuses thus costs the server's process a few reads and
decodes a window and a sleeping coroutine per connection, not work per request, and the
other projects keep its time. The count is per API process.

The fair share (``FairShare``): the process sums each project's share of its time over the
last ``SHARE_WINDOW_S`` seconds (``store.shares.Shares``, decayed). A request is charged its
part of the time it was in flight, shared with the requests in flight beside it (while ``k``
requests are in flight, each is charged ``1/k`` of each second): a neighbour's request slowed
by a flood beside it is charged for the time it was served, not for the time it waited, and
what a project took while no other was there is not charged at all; so slowness the others
cause never puts a project over its share. While the machine's CPUs are at least
``api_share_busy`` busy (half, by default), a request of a project over its share (more than
``SHARE_MARGIN`` times the mean of the projects served in the window, while another project
was served within the last second) waits, before it is read, as long as its project's
requests take on average, at most ``api_share_max_delay_s``: a project that sends requests as
fast as it is answered then sends them at about half that rate while another project is
served and the cores are short, and the work its requests cause (their rows in PostgreSQL,
their replays) slows with them.
A project alone, or on a machine with idle CPU, never waits; a wait is a sleeping coroutine,
not a thread."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
import urllib.parse
from collections import deque
from typing import Any

from store.shares import Shares

__all__ = ["LIMIT_CODES", "SHARE_MARGIN", "SHARE_WINDOW_S", "BodyLimit", "FairShare",
           "NoNulInUrl", "RefusalBudget", "request_project", "request_token"]

#: How long the answer to a project over its refusal budget waits (at most; less when its
#: budget frees sooner), and how many such answers wait at once in one process (more are
#: answered at once): a client that does not honour Retry-After is not answered in a tight
#: loop, and a waiting answer costs the process a sleeping coroutine, not CPU.
HOLD_S = 1.0
MAX_HELD = 256

#: Error codes of a 422 that a limit answered (they count against the refusal budget).
LIMIT_CODES = frozenset({"limit_exceeded", "render_budget"})

_METHODS = {"POST", "PUT", "PATCH"}

log = logging.getLogger(__name__)

#: Seconds over which a project's request time is summed (decayed), for the fair share.
SHARE_WINDOW_S = 5.0
#: A project is over its share past this many times the mean of the projects' sums.
SHARE_MARGIN = 1.25
#: How often (seconds) the machine's CPU use is read again.
_BUSY_EVERY_S = 0.5
#: Most projects whose waits ``FairShare.waits`` keeps.
_MAX_COUNTED = 10_000
#: Where ``request_project`` keeps its answer in a request's state.
_PROJECT_KEPT = "trajstore.request_project"


def request_token(scope: Any) -> str | None:
    """The API key a request carries (``Authorization: Bearer`` or ``X-API-Key``), or
    None."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            text = value.decode("latin-1")
            if text[:7].lower() == "bearer ":
                return text[7:].strip()
        elif name == b"x-api-key":
            return str(value.decode("latin-1").strip())
    return None


def request_project(scope: Any, token: str | None) -> str | None:
    """The project of a request whose key this process trusts already
    (``api.keys.KeyStore.trusted``: no I/O), the local project for a request without a key
    in local mode, else None (a key not checked yet, or no key). Looked up once per request
    and token: the answer is kept in the request's state for the next middleware."""
    state = scope.setdefault("state", {})
    kept = state.get(_PROJECT_KEPT)
    if kept is not None and kept[0] == token:
        return kept[1]
    project: str | None = None
    ctx = getattr(getattr(scope.get("app"), "state", None), "ctx", None)
    if ctx is not None:
        if not token:
            project = ctx.local_key.project if ctx.local_key is not None else None
        else:
            key = ctx.keys.trusted(token)
            project = None if key is None else str(key.project)
    state[_PROJECT_KEPT] = (token, project)
    return project


class BodyLimit:
    """ASGI middleware enforcing ``max_bytes`` on request bodies."""

    def __init__(self, app: Any, *, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def _too_large(self, send: Any, size: int | None) -> None:
        seen = f"{size} bytes" if size is not None else "more"
        body = json.dumps({"error": {
            "code": "payload_too_large",
            "message": f"the request body holds {seen}, over the limit of {self.max_bytes} "
                       "bytes; send smaller batches",
            "limit": self.max_bytes}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") not in _METHODS:
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = None
                if declared is not None and declared > self.max_bytes:
                    await self._too_large(send, declared)
                    return
        # Read the body here, counting, so that a chunked upload over the limit is refused
        # without a route ever buffering it; then hand the body on as one message.
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(send, None)
                return
            parts.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(parts), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class RefusalBudget:
    """ASGI middleware keeping the refusal budget of each project (module docstring): it
    must wrap ``BodyLimit``, so that a project over its budget is answered before its body is
    read. A request's project is known before its body only when its key is one this process
    trusts already (``api.keys.KeyStore.trusted``); a request with another key goes on, and
    its refusal is counted once the key is known. ``budget`` 0 turns it off; ``budget`` < 0
    or ``window_s`` <= 0 raise ValueError."""

    def __init__(self, app: Any, *, budget: int, window_s: float) -> None:
        if budget < 0:
            raise ValueError(f"budget must be >= 0, got {budget}")
        if not window_s > 0 or not math.isfinite(window_s):
            raise ValueError(f"window_s must be a positive number of seconds, got {window_s}")
        self.app = app
        self.budget = budget
        self.window_s = window_s
        self._lock = threading.Lock()
        self._refused: dict[str, deque[float]] = {}
        self._held = 0

    def wait_s(self, project: str, now: float | None = None) -> float:
        """Seconds until ``project`` may be served again; 0 when it is within its budget."""
        with self._lock:
            times = self._refused.get(project)
            if times is None or len(times) < self.budget:
                return 0.0
            left = self.window_s - ((time.monotonic() if now is None else now) - times[0])
            if left <= 0:
                return 0.0
            return left

    def _count(self, project: str) -> None:
        now = time.monotonic()
        with self._lock:
            times = self._refused.get(project)
            if times is None:
                if len(self._refused) > 100_000:  # forget projects quiet for a window
                    self._refused = {p: t for p, t in self._refused.items()
                                     if t and now - t[-1] < self.window_s}
                times = self._refused[project] = deque(maxlen=self.budget)
            times.append(now)

    async def _verified_project(self, scope: Any, token: str | None) -> str | None:
        """The project of a refused request whose key this process did not trust yet (a
        limit answered before any route checked it): the key is checked now, once (the
        process trusts it afterwards); None for a key that is not valid."""
        project = request_project(scope, token)
        if project is not None or not token:
            return project
        from starlette.concurrency import run_in_threadpool

        from api.keys import KeyFailureBudgetExceeded

        ctx = scope["app"].state.ctx
        client = scope.get("client")
        source = client[0] if client else ""
        try:
            if ctx.keys.refused(token, source):
                return None
            key = await run_in_threadpool(ctx.keys.verify, token, source)
        except KeyFailureBudgetExceeded:
            return None
        return None if key is None else str(key.project)

    async def _over_budget(self, send: Any, wait_s: float) -> None:
        if self._held < MAX_HELD:  # the event loop's thread alone counts these
            self._held += 1
            try:
                await asyncio.sleep(min(HOLD_S, wait_s))
            finally:
                self._held -= 1
            wait_s = max(0.0, wait_s - HOLD_S)
        retry = max(1, math.ceil(wait_s))
        body = json.dumps({"error": {
            "code": "too_many_requests",
            "message": f"this project's requests were refused by a limit {self.budget} times "
                       f"within {self.window_s:g} s (setting TRAJSTORE_API_REFUSAL_BUDGET, "
                       f"TRAJSTORE_API_REFUSAL_WINDOW_S); retry after {retry} s",
            "limit": self.budget, "setting": "api_refusal_budget"}}).encode()
        await send({"type": "http.response.start", "status": 429,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"retry-after", str(retry).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.budget:
            await self.app(scope, receive, send)
            return
        token = request_token(scope)
        project = request_project(scope, token)
        if project is not None:
            wait_s = self.wait_s(project)
            if wait_s > 0:
                await self._over_budget(send, wait_s)
                return
        status = 0
        state = scope.setdefault("state", {})  # where the error handler marks a 422 of a limit

        async def watch(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            if status in (413, 429) or state.get("limit_refusal"):
                counted = project or await self._verified_project(scope, token)
                if counted is not None:
                    self._count(counted)


class FairShare:
    """ASGI middleware giving way to the other projects while the machine is busy (module
    docstring). ``max_delay_s`` 0 turns it off; ``busy_from`` is the fraction of the
    machine's CPU in use from which it acts (0: always). A negative or non-finite
    ``max_delay_s``, or a ``busy_from`` outside 0..1, raises ValueError. ``busy``: a
    callable answering the fraction of the machine's CPU in use lately (None: read with
    psutil every ``_BUSY_EVERY_S``)."""

    def __init__(self, app: Any, *, max_delay_s: float, busy_from: float = 0.5,
                 busy: Any = None) -> None:
        if not (math.isfinite(max_delay_s) and max_delay_s >= 0):
            raise ValueError(f"max_delay_s must be a number of seconds >= 0, got "
                             f"{max_delay_s!r}")
        if not (math.isfinite(busy_from) and 0 <= busy_from <= 1):
            raise ValueError(f"busy_from must be a fraction from 0 to 1, got {busy_from!r}")
        self.app = app
        self.max_delay_s = float(max_delay_s)
        self.busy_from = float(busy_from)
        self.shares = Shares(SHARE_WINDOW_S, SHARE_MARGIN)
        self._busy = busy or _MachineBusy()
        #: Project -> how many of its requests waited, and for how long in all (seconds),
        #: since the process started (the projects that waited most recently, at most
        #: ``_MAX_COUNTED``).
        self.waits: dict[str, tuple[int, float]] = {}
        # Requests past the gate and not yet answered, by project (the event loop's thread
        # alone touches these), and the condition the waiting ones are woken by.
        self._in_flight: dict[str, int] = {}
        self._all_in_flight = 0
        # The time each request in flight was served, shared: it grows by dt / k while k
        # requests are in flight, so a request is charged the difference from its start to
        # its end (processor sharing).
        self._served_s = 0.0
        self._served_at = time.monotonic()
        self._waiting = 0
        self._condition: tuple[Any, asyncio.Condition] | None = None

    def delay_s(self, project: str) -> float:
        """How long a request of ``project`` waits now before it is served (0 but for a
        project over its share while the machine is busy)."""
        if not self.shares.over(project):
            return 0.0
        if self.busy_from > 0 and self._busy() < self.busy_from:
            return 0.0
        return min(self.max_delay_s, self.shares.mean_cost(project))

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.max_delay_s:
            await self.app(scope, receive, send)
            return
        project = request_project(scope, request_token(scope))
        if project is None:
            await self.app(scope, receive, send)
            return
        delay = self.delay_s(project)
        if delay > 0:
            await self._give_way(project, delay)
        start = self._share_clock()
        self._in_flight[project] = self._in_flight.get(project, 0) + 1
        self._all_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.shares.add(project, self._share_clock() - start)
            self._all_in_flight -= 1
            left = self._in_flight[project] - 1
            if left:
                self._in_flight[project] = left
            else:
                del self._in_flight[project]
            if self._waiting:
                served = self._served()
                async with served:
                    served.notify_all()

    def _share_clock(self) -> float:
        """Seconds of this process's time each request in flight was served so far, shared
        among them (advanced to now; the event loop's thread alone calls it)."""
        now = time.monotonic()
        if self._all_in_flight:
            self._served_s += max(0.0, now - self._served_at) / self._all_in_flight
        self._served_at = now
        return self._served_s

    def _served(self) -> asyncio.Condition:
        """The condition a request's end notifies, of the running event loop (an app served
        by another loop later gets a new one)."""
        loop = asyncio.get_running_loop()
        if self._condition is None or self._condition[0] is not loop:
            self._condition = (loop, asyncio.Condition())
        return self._condition[1]

    def _others_in_flight(self, project: str) -> int:
        return self._all_in_flight - self._in_flight.get(project, 0)

    async def _give_way(self, project: str, delay: float) -> None:
        """Wait ``delay`` seconds, then for the other projects' requests in flight to end,
        ``max_delay_s`` at most in all; counted in ``waits``."""
        started = time.monotonic()
        self._waiting += 1
        try:
            await asyncio.sleep(delay)
            left = self.max_delay_s - (time.monotonic() - started)
            if left > 0 and self._others_in_flight(project):
                served = self._served()
                async with served:
                    try:
                        await asyncio.wait_for(served.wait_for(
                            lambda: not self._others_in_flight(project)), left)
                    except TimeoutError:
                        pass
        finally:
            self._waiting -= 1
            waited = time.monotonic() - started
            count, total = self.waits.pop(project, (0, 0.0))
            if not count:
                log.info("project %s takes more than its share of the API's time while the "
                         "machine is busy: its requests wait up to %g s for the others' "
                         "(TRAJSTORE_API_SHARE_MAX_DELAY_S)", project, self.max_delay_s)
            if len(self.waits) >= _MAX_COUNTED:
                del self.waits[next(iter(self.waits))]
            self.waits[project] = (count + 1, total + waited)


class _MachineBusy:
    """The fraction (0 to 1) of the machine's CPU time in use since the last reading, read
    again at most every ``_BUSY_EVERY_S`` seconds (0.0 where it cannot be read)."""

    def __init__(self) -> None:
        self._at = 0.0
        self._value = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        now = time.monotonic()
        if now - self._at < _BUSY_EVERY_S:
            return self._value
        with self._lock:
            if now - self._at >= _BUSY_EVERY_S:
                try:
                    import psutil

                    self._value = float(psutil.cpu_percent(interval=None)) / 100.0
                except Exception:  # noqa: BLE001 - no reading: never busy
                    self._value = 0.0
                self._at = now
        return self._value


class NoNulInUrl:
    """ASGI middleware answering 422 to a request whose path or query string decodes to
    text holding NUL (``%00``), naming the query parameter (or ``path``)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            where = _nul_in_url(scope)
            if where is not None:
                body = json.dumps({"error": {
                    "code": "invalid_request",
                    "message": f"{where}: must not contain a NUL character (%00)",
                    "field": where}}).encode()
                await send({"type": "http.response.start", "status": 422,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def _nul_in_url(scope: Any) -> str | None:
    if "\x00" in scope.get("path", ""):
        return "path"
    query = scope.get("query_string", b"")
    if b"%00" not in query and b"\x00" not in query:
        return None
    for name, value in urllib.parse.parse_qsl(query.decode("latin-1"), keep_blank_values=True,
                                              encoding="utf-8", errors="replace"):
        if "\x00" in value or "\x00" in name:
            return name.replace("\x00", "\\x00")[:100] or "query"
    return None
