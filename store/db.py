"""The one module that talks to psycopg: connections, transactions and error translation.

Every driver error leaves this module as one of ``store.errors``: connection loss,
serialization failures, deadlocks and server shutdowns become ``TransientError`` (the only
kind worth retrying); unique violations become ``DuplicateKeyError`` naming the constraint;
privilege and trigger refusals become ``RefusedError``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import re
import struct
import uuid
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import psycopg
from psycopg import errors as pg_errors
from psycopg import pq
from psycopg.adapt import Dumper
from psycopg.types.json import set_json_loads
from psycopg_pool import ConnectionPool

from store import errors

__all__ = [
    "Database",
    "data_error_message",
    "translate_errors",
    "connect",
    "scalar",
    "BinaryArray",
    "NotBinary",
    "uuid_array",
    "text_array",
    "int4_array",
    "int2_array",
    "bytea_array",
    "timestamptz_array",
]

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


# --- array parameters in PostgreSQL's binary format ---------------------------------------
#
# psycopg adapts a list parameter element by element: a dumper looked up, called and its
# output copied for every value, which for the append's many array columns costs more CPU
# than the rest of the append together. Where the element type is known, the array is built
# here at once in the server's binary array format (array_send: dimensions, flags, element
# oid, then each element as a length and its binary value, -1 for NULL) and handed to the
# driver whole. The server receives the same array of the same values as from psycopg's
# own dumpers; a value these encoders do not take raises NotBinary, so that the caller can
# pass the plain list instead and psycopg decides (and errs) as it always did.


class NotBinary(Exception):
    """A value that the binary array encoders do not encode (another type, out of range)."""


class BinaryArray:
    """A one-dimensional array in PostgreSQL's binary format, passed as a query parameter
    (``%b`` or ``%s``) with its array type's oid. Built by the ``*_array`` functions."""

    __slots__ = ("data",)
    oid: ClassVar[int] = 0
    element_oid: ClassVar[int] = 0

    def __init__(self, data: bytes) -> None:
        self.data = data


class _BinaryArrayDumper(Dumper):
    format = pq.Format.BINARY

    def dump(self, obj: BinaryArray) -> bytes:
        return obj.data


def _array_type(name: str, oid: int, element_oid: int) -> type[BinaryArray]:
    cls = type(name, (BinaryArray,), {"__slots__": (), "oid": oid, "element_oid": element_oid})
    psycopg.adapters.register_dumper(cls, type(f"_{name}Dumper", (_BinaryArrayDumper,),
                                               {"oid": oid}))
    return cls


_UUIDS = _array_type("UuidArray", 2951, 2950)
_TEXTS = _array_type("TextArray", 1009, 25)
_INT4S = _array_type("Int4Array", 1007, 23)
_INT2S = _array_type("Int2Array", 1005, 21)
_BYTEAS = _array_type("ByteaArray", 1001, 17)
_TIMESTAMPTZS = _array_type("TimestamptzArray", 1185, 1184)

# ndim, has-nulls flag, element oid, length and lower bound of the one dimension.
_HEADER = struct.Struct(">iiiii")
_NULL = b"\xff\xff\xff\xff"
_LENGTH = struct.Struct(">i")
_UUID_LENGTH = _LENGTH.pack(16)
_INT4 = struct.Struct(">ii")  # length 4, value
_INT2 = struct.Struct(">ih")  # length 2, value
_INT8 = struct.Struct(">iq")  # length 8, value
_PG_EPOCH = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)


def _array(cls: type[BinaryArray], count: int, nulls: int, body: bytes) -> BinaryArray:
    return cls(_HEADER.pack(1, nulls, cls.element_oid, count, 1) + body)


def uuid_array(values: Sequence[Any]) -> BinaryArray:
    """``uuid[]`` of ``values``; NotBinary unless every one is a ``uuid.UUID`` (no NULL)."""
    for value in values:
        if type(value) is not uuid.UUID:
            raise NotBinary(value)
    body = b"".join([_UUID_LENGTH + value.bytes for value in values])
    return _array(_UUIDS, len(values), 0, body)


def text_array(values: Sequence[Any]) -> BinaryArray:
    """``text[]`` of ``values`` (str or None) encoded as UTF-8, the connection's encoding
    (the caller checks it); NotBinary for any other value or one UTF-8 cannot encode (a
    lone surrogate). A NUL goes through as psycopg sends it: the server refuses it."""
    pack = _LENGTH.pack
    try:
        "".join([v for v in values if v is not None])  # TypeError unless each is a str
        body = b"".join([_NULL if v is None else pack(len(e := v.encode())) + e
                         for v in values])
    except (TypeError, UnicodeEncodeError):
        raise NotBinary(values) from None
    return _array(_TEXTS, len(values), 1 if None in values else 0, body)


def _int_array(cls: type[BinaryArray], item: struct.Struct, bits: int,
               values: Sequence[Any]) -> BinaryArray:
    parts: list[bytes] = []
    nulls = 0
    low, high = -(1 << (bits - 1)), 1 << (bits - 1)
    pack = item.pack
    for value in values:
        if value is None:
            parts.append(_NULL)
            nulls = 1
        elif type(value) is int and low <= value < high:
            parts.append(pack(bits // 8, value))
        else:
            raise NotBinary(value)
    return _array(cls, len(values), nulls, b"".join(parts))


def int4_array(values: Sequence[Any]) -> BinaryArray:
    """``int4[]`` of ``values`` (int or None); NotBinary for any other value (a bool too)
    or one beyond 32 bits, which psycopg would send as a wider type for the server to
    refuse."""
    return _int_array(_INT4S, _INT4, 32, values)


def int2_array(values: Sequence[Any]) -> BinaryArray:
    """``int2[]`` of ``values`` (int or None); NotBinary as ``int4_array`` past 16 bits."""
    return _int_array(_INT2S, _INT2, 16, values)


def bytea_array(values: Sequence[Any]) -> BinaryArray:
    """``bytea[]`` of ``values`` (bytes or None); NotBinary for any other value."""
    parts: list[bytes] = []
    nulls = 0
    pack = _LENGTH.pack
    for value in values:
        if value is None:
            parts.append(_NULL)
            nulls = 1
        elif type(value) is bytes:
            parts.append(pack(len(value)))
            parts.append(value)
        else:
            raise NotBinary(value)
    return _array(_BYTEAS, len(values), nulls, b"".join(parts))


def timestamptz_array(values: Sequence[Any]) -> BinaryArray:
    """``timestamptz[]`` of ``values``: microseconds since 2000-01-01 UTC, as psycopg's
    binary dumper computes them. NotBinary for a NULL, a naive time (psycopg sends those
    as ``timestamp`` for the server to read in its time zone) or any other value."""
    parts: list[bytes] = []
    pack = _INT8.pack
    for value in values:
        if type(value) is not dt.datetime or value.utcoffset() is None:
            raise NotBinary(value)
        delta = value - _PG_EPOCH
        parts.append(pack(8, delta.microseconds
                          + 1_000_000 * (86_400 * delta.days + delta.seconds)))
    return _array(_TIMESTAMPTZS, len(values), 0, b"".join(parts))


def connect(url: str, **kwargs: Any) -> psycopg.Connection:
    """A single connection to ``url`` (errors translated)."""
    with translate_errors():
        return psycopg.connect(url, **kwargs)


#: How the server words a connection refused for good (libpq gives no SQLSTATE for a failed
#: connection): no such database, no such role, a wrong password. Waiting changes none.
_PERMANENT = re.compile(r'FATAL: +(database "[^"]*" does not exist|role "[^"]*" does not exist'
                        r'|password authentication failed)')


def _refuse_permanent(url: str, options: str) -> None:
    """Raise StoreError at once when the server refuses ``url`` for a reason that waiting
    does not change (:data:`_PERMANENT`); a server that is down or starting is left to the
    pool, which keeps trying for 30 seconds."""
    try:
        psycopg.connect(url, options=options, connect_timeout=10).close()
    except psycopg.OperationalError as exc:
        if _PERMANENT.search(str(exc)):
            raise errors.StoreError(str(exc).strip()) from exc


class Database:
    """A pool of connections to one PostgreSQL database. A database that does not exist
    or refuses the credentials raises StoreError at once; one that cannot be reached
    raises TransientError after 30 seconds of trying."""

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
        _refuse_permanent(url, options)
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
