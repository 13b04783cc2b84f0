"""The append's array parameters built in PostgreSQL's binary format (``store.db``): the
server reads from them exactly the arrays psycopg's own adaptation of the lists gives, and a
value the encoders do not take is refused with ``NotBinary`` (the caller then passes the
list, which ``test_append_contract.py`` checks through every append path)."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from store.db import (
    NotBinary,
    bytea_array,
    int2_array,
    int4_array,
    text_array,
    timestamptz_array,
    uuid_array,
)

_CEST = dt.timezone(dt.timedelta(hours=2))

CASES: list[tuple[Callable[[Any], Any], str, list[Any]]] = [
    (uuid_array, "uuid", [uuid.uuid4(), uuid.UUID(int=0), uuid.UUID(int=2**128 - 1)]),
    (text_array, "text", ["", "a", None, "ünïcödé ✓ 𝄞", "x" * 5000]),
    (text_array, "text", [None, None]),
    (int4_array, "int4", [0, 1, -1, 2**31 - 1, -(2**31), None]),
    (int2_array, "int2", [1, None, 2**15 - 1, -(2**15)]),
    (bytea_array, "bytea", [b"", b"\x00\x01\xff", None, bytes(range(256)) * 3]),
    (timestamptz_array, "timestamptz", [
        dt.datetime(2000, 1, 1, tzinfo=dt.UTC),
        dt.datetime(1999, 12, 31, 23, 59, 59, 999999, tzinfo=dt.UTC),
        dt.datetime(2026, 11, 28, 6, 30, 1, 123456, tzinfo=_CEST),
        dt.datetime(1, 1, 1, tzinfo=dt.UTC),
        dt.datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=dt.UTC),
    ]),
]


@pytest.mark.parametrize(("encode", "sql_type", "values"), CASES,
                         ids=[f"{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_the_server_reads_what_psycopg_would_send(pg_url: str, encode: Callable[[Any], Any],
                                                  sql_type: str, values: list[Any]) -> None:
    with psycopg.connect(pg_url) as conn:
        ours, theirs, same = conn.execute(
            f"SELECT %b::{sql_type}[], %b::{sql_type}[],"
            f" %b::{sql_type}[] IS NOT DISTINCT FROM %b::{sql_type}[]",
            (encode(values), values, encode(values), values),
        ).fetchone()
    assert same
    assert ours == theirs


@pytest.mark.parametrize(("encode", "value"), [
    (uuid_array, "3a42e2bb-1f66-45f2-b50d-901a32ffd4c1"),
    (uuid_array, None),
    (text_array, b"bytes"),
    (text_array, "lone \ud800 surrogate"),
    (int4_array, True),
    (int4_array, 2**31),
    (int4_array, 1.0),
    (int2_array, 2**15),
    (bytea_array, bytearray(b"x")),
    (bytea_array, "text"),
    (timestamptz_array, dt.datetime(2026, 1, 1)),  # naive: psycopg sends a timestamp
    (timestamptz_array, None),
    (timestamptz_array, dt.date(2026, 1, 1)),
])
def test_a_value_the_encoders_do_not_take_is_refused(encode: Callable[[Any], Any],
                                                      value: Any) -> None:
    with pytest.raises(NotBinary):
        encode([value])
