"""Fast detection of dead rollout workers: heartbeats, group leases and their requeue.

A group task is acknowledged late, so the broker delivers it again when its worker dies, but
only after the visibility timeout (an hour by default). To resume a dead worker's episodes
within seconds instead, every rollout worker process keeps, in the broker's Redis (keys under
``redis_key_prefix``):

- ``rollout:alive:<worker>``: its heartbeat, renewed every ``rollout_heartbeat_s`` by a
  thread of the process, expiring ``rollout_dead_after_s`` after the last renewal;
- ``rollout:leases`` (a hash): one entry per group task in flight, naming the worker and the
  task with its arguments (the policy version pinned, so a requeued group is the same group
  whatever the run's policy is by then), written when the task starts and removed when it
  returns or raises.

The same thread (the watcher, in every rollout worker) reads the leases; one whose worker's
heartbeat has expired is claimed with ``SET NX`` on ``rollout:requeued:<lease>`` (so exactly
one watcher wins it), its task sent again to the ``rollout`` queue and the lease removed.
Whichever worker takes the new message resumes the group's episodes from the log
(:mod:`workers.rollout.group`). A worker restarted after a kill runs the watcher as soon as it
is ready, so a lone worker that is restarted resumes its own groups.

A worker that was only slow (its heartbeat thread starved past the deadline) still plays the
groups that were requeued: both then append to the same episodes, each append expecting the
version the previous one left, so the first append of each event wins and the other player
gets a conflict and leaves the slot (no event, LLM call or tool result is stored twice; a
non-idempotent tool the slow worker was running is answered in the log as interrupted by the
other, and the slow worker's late result is refused). The original message is still
delivered again after the visibility timeout; that delivery finds the group finished.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from store.settings import Settings

__all__ = ["HeldLease", "Liveness", "group_lease", "liveness", "start_watcher", "stop_watcher"]

_log = logging.getLogger(__name__)

#: Celery task names a lease may requeue (the rollout queue's resumable tasks).
REQUEUABLE = frozenset({"trajstore.rollout_group", "trajstore.branch_episode"})


def _redis_client(settings: Settings) -> Any:
    import redis

    from store import embedded

    url = embedded.redis_url(settings)
    # kombu's name for a unix socket; redis-py calls it unix://
    if url.startswith("redis+socket://"):
        url = "unix://" + url.removeprefix("redis+socket://")
    return redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=5)


class Liveness:
    """One rollout worker process's heartbeat and leases, and the watcher that requeues the
    leases of dead workers (module docstring). ``send`` queues a task (name, args, kwargs);
    Celery's ``send_task`` to the ``rollout`` queue by default."""

    def __init__(self, settings: Settings, *, client: Any = None,
                 send: Callable[[str, list[Any], dict[str, Any]], None] | None = None,
                 worker_id: str | None = None) -> None:
        self.settings = settings
        self.client = client if client is not None else _redis_client(settings)
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        prefix = settings.redis_key_prefix
        self._alive_prefix = f"{prefix}rollout:alive:"
        self._leases = f"{prefix}rollout:leases"
        self._claims = f"{prefix}rollout:requeued:"
        self._send = send or _celery_send
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.requeued: list[str] = []

    # -- this worker ------------------------------------------------------------------------

    def beat(self) -> None:
        """Renew this worker's heartbeat."""
        ttl_ms = max(1, int(self.settings.rollout_dead_after_s * 1000))
        self.client.set(self._alive_prefix + self.worker_id, str(time.time()), px=ttl_ms)

    def take(self, task: str, args: list[Any], kwargs: dict[str, Any]) -> str:
        """Lease a task in flight on this worker; returns the lease id. ValueError for a task
        that cannot be requeued."""
        if task not in REQUEUABLE:
            raise ValueError(f"{task!r} is not a task a lease can requeue "
                             f"(known: {', '.join(sorted(REQUEUABLE))})")
        lease = uuid.uuid4().hex
        self.beat()  # alive before the lease is visible, or a watcher may take it for dead
        self.client.hset(self._leases, lease, json.dumps(
            {"worker": self.worker_id, "task": task, "args": args, "kwargs": kwargs,
             "taken_at": time.time()}))
        return lease

    def pin(self, lease: str, kwargs: dict[str, Any]) -> None:
        """Set the keyword arguments a requeue of ``lease`` sends (the policy version once the
        task has resolved it); nothing when the lease is gone (requeued meanwhile)."""
        raw = self.client.hget(self._leases, lease)
        if raw is None:
            return
        entry = json.loads(raw)
        entry["kwargs"] = kwargs
        self.client.hset(self._leases, lease, json.dumps(entry))

    def release(self, lease: str) -> None:
        """The task returned (or raised): its lease is gone."""
        self.client.hdel(self._leases, lease)

    # -- the watcher ------------------------------------------------------------------------

    def sweep(self) -> list[str]:
        """Requeue, once, every lease whose worker's heartbeat has expired; returns the
        leases this call requeued. A lease that cannot be read is removed (logged)."""
        done: list[str] = []
        leases = self.client.hgetall(self._leases)
        if not leases:
            return done
        workers: dict[str, Any] = {}
        for raw_id, raw in leases.items():
            lease = raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id)
            try:
                entry = json.loads(raw)
                worker, task = str(entry["worker"]), str(entry["task"])
                args, kwargs = list(entry["args"]), dict(entry["kwargs"])
            except (ValueError, KeyError, TypeError) as exc:
                _log.error("rollout lease %s cannot be read (%s); removed", lease, exc)
                self.client.hdel(self._leases, lease)
                continue
            if worker == self.worker_id:
                continue
            if worker not in workers:
                workers[worker] = self.client.exists(self._alive_prefix + worker)
            if workers[worker]:
                continue
            claim_ttl = max(60, int(self.settings.visibility_timeout_s))
            if not self.client.set(self._claims + lease, self.worker_id, nx=True, ex=claim_ttl):
                continue  # another watcher requeued it
            self._send(task, args, kwargs)
            self.client.hdel(self._leases, lease)
            _log.warning("rollout worker %s stopped beating: its %s %s queued again", worker,
                         task, args)
            done.append(lease)
        self.requeued.extend(done)
        return done

    def _run(self) -> None:
        interval = self.settings.rollout_heartbeat_s
        while not self._stop.is_set():
            try:
                self.beat()
                self.sweep()
            except Exception:  # Redis away: try again at the next beat
                _log.exception("rollout heartbeat failed")
            self._stop.wait(interval)

    def start(self) -> None:
        """Start the heartbeat and watcher thread (once)."""
        if self._thread is None:
            self.beat()
            self._thread = threading.Thread(target=self._run, name="rollout-liveness",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the thread and drop the heartbeat (a clean stop; its leases are released by
        their tasks)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            self.client.delete(self._alive_prefix + self.worker_id)
        except Exception:
            _log.warning("rollout heartbeat not removed at stop", exc_info=True)


def _celery_send(task: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    from workers.app import ensure_configured

    ensure_configured().send_task(task, args=args, kwargs=kwargs, queue="rollout")


_lock = threading.Lock()
_liveness: Liveness | None = None


def liveness(settings: Settings) -> Liveness:
    """The process's :class:`Liveness`, started on first use."""
    global _liveness
    with _lock:
        if _liveness is None:
            _liveness = Liveness(settings)
            _liveness.start()
        return _liveness


def start_watcher(settings: Settings) -> Liveness:
    """Start the process's heartbeat and watcher (a rollout worker, once it is ready)."""
    return liveness(settings)


def stop_watcher() -> None:
    global _liveness
    with _lock:
        if _liveness is not None:
            _liveness.stop()
            _liveness = None


class HeldLease:
    """A lease held by :func:`group_lease`: its id, and :meth:`pin` to change what a
    requeue sends."""

    def __init__(self, live: Liveness, lease: str) -> None:
        self.live, self.lease = live, lease

    def pin(self, kwargs: dict[str, Any]) -> None:
        self.live.pin(self.lease, kwargs)


@contextmanager
def group_lease(settings: Settings, task: str, args: list[Any],
                kwargs: dict[str, Any]) -> Iterator[HeldLease]:
    """Hold a lease on ``task`` while the block runs (module docstring)."""
    live = liveness(settings)
    lease = live.take(task, args, kwargs)
    try:
        yield HeldLease(live, lease)
    finally:
        try:
            live.release(lease)
        except Exception:  # Redis away: the lease is requeued if this worker dies, else stays
            _log.warning("rollout lease %s not released", lease, exc_info=True)
