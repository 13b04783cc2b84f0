"""The one module that talks to psycopg: connections, transactions and error translation.

Every driver error leaves this module as one of ``store.errors``: connection loss,
serialization failures, deadlocks and server shutdowns become ``TransientError`` (the only
kind worth retrying); unique violations become ``DuplicateKeyError`` naming the constraint;
privilege and trigger refusals become ``RefusedError``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg.types.json import set_json_loads
from psycopg_pool import ConnectionPool

from store import errors

__all__ = ["Database", "translate_errors", "connect", "scalar"]

_TRANSIENT = (
    psycopg.OperationalError,
    pg_errors.SerializationFailure,
    pg_errors.DeadlockDetected,
    pg_errors.AdminShutdown,
    pg_errors.CannotConnectNow,
    pg_errors.QueryCanceled,
)


@contextlib.contextmanager
def translate_errors() -> Iterator[None]:
    """Re-raise psycopg errors raised inside the block as ``store.errors``: unique
    violations as ``DuplicateKeyError``, refused writes as ``RefusedError``, lost connections
    as ``TransientError``, values PostgreSQL cannot hold (``DataError``) as
    ``ValidationError``, anything else as ``StoreError``."""
    try:
        yield
    except errors.StoreError:
        raise
    except pg_errors.UniqueViolation as exc:
        constraint = exc.diag.constraint_name
        raise errors.DuplicateKeyError(constraint, str(exc).strip()) from exc
    except (pg_errors.InsufficientPrivilege, pg_errors.RaiseException) as exc:
        raise errors.RefusedError(str(exc).strip()) from exc
    except _TRANSIENT as exc:
        raise errors.TransientError(f"database unavailable: {str(exc).strip()}") from exc
    except psycopg.DataError as exc:
        # A value PostgreSQL cannot hold (a NUL character in a text column, a number out of
        # range): the caller's input is wrong, not the database.
        raise errors.ValidationError(str(exc).strip()) from exc
    except pg_errors.UndefinedTable as exc:
        raise errors.StoreError(
            f"{str(exc).strip()} (is the schema migrated? run `trajstore migrate`)"
        ) from exc
    except psycopg.Error as exc:
        raise errors.StoreError(str(exc).strip()) from exc


def scalar(conn: psycopg.Connection, sql: Any, params: Any = None) -> Any:
    """The first column of the one row ``sql`` returns (for aggregates, which always do)."""
    row = conn.execute(sql, params).fetchone()
    if row is None:
        raise errors.StoreError(f"expected a row from: {sql}")
    return row[0]


def _loads(data: bytes | bytearray | memoryview | str) -> Any:
    """JSON from PostgreSQL, with U+FFFD in place of each NUL escape: a row stored before
    appends refused NUL (``store.validation``) must still read, and what is read from it must
    be writable to the projections (PostgreSQL text cannot hold NUL)."""
    if isinstance(data, str):
        return json.loads(data.replace("\\u0000", "\\ufffd") if "\\u0000" in data else data)
    raw = bytes(data)
    if b"\\u0000" in raw:
        raw = raw.replace(b"\\u0000", b"\\ufffd")
    return json.loads(raw)


set_json_loads(_loads)


def connect(url: str, **kwargs: Any) -> psycopg.Connection:
    """A single connection to ``url`` (errors translated)."""
    with translate_errors():
        return psycopg.connect(url, **kwargs)


class Database:
    """A pool of connections to one PostgreSQL database."""

    def __init__(
        self,
        url: str,
        *,
        min_size: int = 1,
        max_size: int = 8,
        statement_timeout_ms: int = 60_000,
    ) -> None:
        self.url = url
        options = f"-c statement_timeout={int(statement_timeout_ms)}"
        self._pool = ConnectionPool(
            url,
            min_size=min_size,
            max_size=max_size,
            kwargs={"options": options},
            open=False,
            check=ConnectionPool.check_connection,
        )
        with translate_errors():
            self._pool.open(wait=True, timeout=30)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[psycopg.Connection]:
        """A pooled connection inside one transaction: committed when the block ends,
        rolled back when it raises."""
        with translate_errors():
            with self._pool.connection() as conn:
                with conn.transaction():
                    yield conn

    @contextlib.contextmanager
    def connection(self) -> Iterator[psycopg.Connection]:
        """A pooled connection in autocommit-per-statement use (each statement its own
        transaction unless the caller opens one)."""
        with translate_errors():
            with self._pool.connection() as conn:
                yield conn

    def close(self) -> None:
        self._pool.close()

    def __enter__(self) -> Database:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
