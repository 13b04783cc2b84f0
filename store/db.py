"""The one module that talks to psycopg: connections, transactions and error translation.

Every driver error leaves this module as one of ``store.errors``: connection loss,
serialization failures, deadlocks and server shutdowns become ``TransientError`` (the only
kind worth retrying); unique violations become ``DuplicateKeyError`` naming the constraint;
privilege and trigger refusals become ``RefusedError``.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg.types.json import set_json_loads
from psycopg_pool import ConnectionPool

from store import errors

__all__ = ["Database", "data_error_message", "translate_errors", "connect", "scalar"]

log = logging.getLogger(__name__)

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
    ``ValidationError`` with a message of the store's own (``from_database`` set; the
    server's text is logged, never put in the error), anything else as ``StoreError``."""
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
        # range): the caller's input is wrong, not the database. The server's text (which
        # quotes SQL and internals) goes to the log only; the error says it in our words.
        log.warning("the database refused a value (SQLSTATE %s): %s", exc.sqlstate,
                    str(exc).strip())
        raise errors.ValidationError(data_error_message(exc), from_database=True) from exc
    except pg_errors.UndefinedTable as exc:
        raise errors.StoreError(
            f"{str(exc).strip()} (is the schema migrated? run `trajstore migrate`)"
        ) from exc
    except psycopg.Error as exc:
        raise errors.StoreError(str(exc).strip()) from exc


#: Our words for the SQLSTATEs of class 22 (data exception) a caller's value can cause.
_DATA_ERRORS = {
    "22003": "a number is out of range for the database",
    "22008": "a time or duration is out of range for the database",
    "22015": "a duration is out of range for the database",
    "22007": "a time is not in a form the database reads",
    "22P02": "a value is not in the form its column takes",
    "22021": "a string holds a character the database cannot store",
    "22P05": "a string holds a character the database cannot store",
    "22001": "a string is longer than the database holds",
    "22012": "a value divides by zero",
    "2201E": "a value is outside what a logarithm takes",
    "22023": "a value is not one the database takes",
}


def data_error_message(exc: psycopg.DataError) -> str:
    """What a ``DataError`` means for the caller, in the store's words (never the server's
    text, which quotes SQL)."""
    if exc.sqlstate in _DATA_ERRORS:
        return _DATA_ERRORS[exc.sqlstate]
    if exc.sqlstate is None and "NUL" in str(exc):  # refused by psycopg before sending
        return "a string holds a NUL character, which the database cannot store"
    return "a value is one the database cannot hold"


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
