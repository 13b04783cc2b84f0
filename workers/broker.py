"""The broker as every room of ``workers`` talks to it: a Redis client and a Celery sender per
broker, one of each per process, and the one error a broker that cannot be reached raises.

The broker is the Redis the settings name (the embedded one when they name none), under the
workers' key prefix. A sender is a Celery application configured for the settings it was made
with (the API's settings need not be the process environment's), so that a task sent from
anywhere (an API process, a worker's finishing task, the replay dispatcher) reaches the queues
the workers consume. Connections are closed at exit, before the embedded Redis's own exit
handler, which stops the server only when its owner is its last client.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Mapping
from typing import Any

from store.settings import Settings

__all__ = ["broker_url", "plain_url", "redis_client", "send_task", "unreachable"]

_lock = threading.Lock()
_senders: dict[tuple[str, str], Any] = {}
_clients: dict[str, Any] = {}
_closing = False


def broker_url(settings: Settings) -> str:
    """The broker's URL in kombu's spelling (the embedded server is started when the settings
    name none)."""
    from store import embedded

    return embedded.redis_url(settings)


def plain_url(settings: Settings) -> str:
    """The broker's URL as redis-py takes it (kombu spells a unix socket
    ``redis+socket://``)."""
    url = broker_url(settings)
    return ("unix://" + url.removeprefix("redis+socket://")
            if url.startswith("redis+socket://") else url)


def _close_all() -> None:
    """Close this module's connections. The embedded Redis stops at exit only when its
    owner is its last client, so these must be gone first: registered after the server's
    own exit handler, this runs before it."""
    with _lock:
        for client in _clients.values():
            client.close()
            client.connection_pool.disconnect()
        for app in _senders.values():
            app.close()
        _clients.clear()
        _senders.clear()


def _remember_to_close() -> None:
    global _closing
    if not _closing:
        atexit.register(_close_all)
        _closing = True


def redis_client(settings: Settings) -> Any:
    """A Redis client of the broker (one per URL and process)."""
    import redis

    url = broker_url(settings)
    with _lock:
        client = _clients.get(url)
        if client is None:
            client = redis.Redis.from_url(plain_url(settings))
            _clients[url] = client
            _remember_to_close()
        return client


def _sender(settings: Settings) -> Any:
    """A Celery app configured for ``settings``, made once per broker and key prefix."""
    from celery import Celery

    from workers.app import configure

    key = (broker_url(settings), settings.redis_key_prefix)
    with _lock:
        app = _senders.get(key)
        if app is None:
            app = Celery("trajstore")
            configure(app, settings)
            _senders[key] = app
            _remember_to_close()
        return app


def unreachable(settings: Settings, exc: BaseException) -> ConnectionError:
    """The error a broker that cannot be reached raises, naming it (never its password: the
    URL as the settings give it, or the embedded Redis)."""
    where = settings.redis_url or "the embedded Redis"
    return ConnectionError(f"the broker ({where}) cannot be reached: {exc}")


def send_task(settings: Settings, name: str, *, queue: str, args: list[Any],
              kwargs: Mapping[str, Any] | None = None, argsrepr: str | None = None,
              pooled: bool = False) -> None:
    """Queue the task ``name`` on ``queue``; ConnectionError naming the broker when it cannot
    be reached. Each send opens a connection of its own and closes it, unless ``pooled``:
    then the sender's pool keeps its connections open until the process exits (for
    processes that send often, a replay worker and its follower of the log: a connection of
    one's own costs several milliseconds, a pooled send a fraction of one)."""
    from kombu.exceptions import OperationalError

    app = _sender(settings)
    try:
        if pooled:
            app.send_task(name, args=args, kwargs=dict(kwargs or {}), queue=queue,
                          argsrepr=argsrepr)
            return
        # A connection of its own, closed after the send: a pooled one would outlive the
        # process's last request and keep an embedded Redis from stopping at exit.
        with app.connection_for_write() as connection:
            app.send_task(name, args=args, kwargs=dict(kwargs or {}), queue=queue,
                          connection=connection, argsrepr=argsrepr)
    except OperationalError as exc:
        raise unreachable(settings, exc) from None
