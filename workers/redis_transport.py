"""kombu's Redis transport with one guard, for every Celery connection of the workers.

A worker whose broker goes away while it holds an unacknowledged message (a replay running,
``acks_late``) must reconnect once Redis is back. With kombu 5.7.0 (Celery 5.7) it stops
instead. On the connection error Celery's consumer first collects the connection: closing its
channels fails on the dead socket (the error is swallowed) and the transport lets go of the
connection (``Connection._do_close_transport`` sets ``transport.client = None``). Then it
closes the connection, which closes the channel again; this time the close gets as far as
restoring the unacknowledged message, through a new connection pool, for which the channel
reads the broker's address from ``self.connection.client`` (``Channel._connparams``):
``AttributeError: 'NoneType' object has no attribute 'hostname'``. Celery does not take that
for a connection error: the worker logs "Unrecoverable error" and shuts down. The running
task's acknowledgement, sent on the same channel when it finishes, would fail the same way
(and once the channel is closed for good its ``connection`` is None too). The same
AttributeError, by other paths, is upstream's celery/kombu#582 and #970.

The guard: a channel keeps the parameters of the last connection pool it made while its
transport held the connection, and makes later pools from them. The restore and the
acknowledgement then reach Redis if it is back, or fail with a connection error that Celery
handles (the message stays unacknowledged in Redis and is delivered again after the
visibility timeout; the tasks are idempotent). While the transport holds the connection the
channel is kombu's, unchanged, so a kombu that mends this leaves the guard idle.
:func:`install` makes this the transport of the ``redis``, ``rediss`` and ``redis+socket``
URLs (kombu resolves each through its alias table) in this process; ``workers.app`` calls it
on import.
"""

from __future__ import annotations

from typing import Any

from kombu import transport as kombu_transports
from kombu.transport import redis as kombu_redis

__all__ = ["ALIASES", "Channel", "Transport", "install"]

#: The kombu aliases (URL schemes) the guarded transport takes over.
ALIASES = ("redis", "rediss")


class Channel(kombu_redis.Channel):
    """kombu's Redis channel that can still reach the broker after its transport has let go
    of the connection (module docstring)."""

    _kept_connparams: dict[str, Any] | None = None

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        # kombu 5.7.0 reads the address from self.connection.client, which is None once
        # Connection.collect() has released the transport (and self.connection is None once
        # the channel is closed): kept from the last pool made while it was there.
        transport = self.connection
        if transport is not None and transport.client is not None:
            params: dict[str, Any] = super()._connparams(asynchronous=asynchronous)
            if not asynchronous:
                self._kept_connparams = dict(params)
            return params
        if asynchronous or self._kept_connparams is None:
            # Nothing to go on: kombu's own AttributeError, as before.
            result: dict[str, Any] = super()._connparams(asynchronous=asynchronous)
            return result
        return dict(self._kept_connparams)


class Transport(kombu_redis.Transport):
    """kombu's Redis transport with :class:`Channel`."""

    Channel = Channel


def install() -> None:
    """Make :class:`Transport` the transport of the Redis URLs in this process (kombu's alias
    table, and its cache of resolved aliases). Calling it again changes nothing."""
    path = f"{__name__}:Transport"
    for alias in ALIASES:
        kombu_transports.TRANSPORT_ALIASES[alias] = path
        kombu_transports._transport_cache.pop(alias, None)
