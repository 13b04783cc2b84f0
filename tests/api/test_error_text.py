"""No answer holds PostgreSQL's own text: a value the database refuses is a 422 in the store's
words naming the field or parameter, and the server's text goes to the log only."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from fastapi import Query
from fastapi.testclient import TestClient

from api.app import create_app
from store import errors
from store.db import translate_errors
from store.eventlog import EventStore
from store.settings import Settings

#: Pieces of PostgreSQL's and psycopg's error text that must never reach a client.
SERVER_TEXT = ("psycopg", "PostgreSQL", "ERROR:", "LINE 1", "DETAIL", "CONTEXT", "SELECT ",
               "::", "0x00", "out of range for type", "integer out of range",
               "invalid input syntax", "violates")


def assert_no_server_text(text: str) -> None:
    for piece in SERVER_TEXT:
        assert piece not in text, (piece, text[:400])


@pytest.mark.parametrize("cookie", [
    '"tss1.\\000.9999999999.x"',           # a NUL in the key id (the cookie's octal escape)
    '"tss1.ab\\000cdef0123456789.9999999999.x"',
    "tss1.zz.99999999999999999999999.x",
    "tss1." + "f" * 300 + ".9999999999.x",
])
@pytest.mark.parametrize("path", ["/ui", "/ui/runs/run-x"])
def test_a_forged_session_cookie_is_no_session(client: TestClient, cookie: str,
                                               path: str) -> None:
    """Such a cookie used to reach the database, whose refusal of the NUL came back as a 422
    quoting psycopg; it is simply no session now (the page asks for a key)."""
    r = client.get(path, headers={"Cookie": f"trajstore_key={cookie}"}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"].startswith("/ui/login"), (
        r.status_code, r.text[:300])
    assert_no_server_text(r.text)


@pytest.mark.parametrize(("sql", "value", "words"), [
    ("SELECT %s::int", 2**40, "a number is out of range"),
    ("SELECT %s::text", "a\x00b", "NUL character"),
    ("SELECT %s::timestamptz", "2020-13-45", "a time"),
    ("SELECT %s::uuid", "not-a-uuid", "not in the form"),
    ("SELECT %s::interval * 1e300", "1 day", "duration"),
])
def test_a_database_refusal_is_told_in_the_stores_words(
        api_store: EventStore, caplog: pytest.LogCaptureFixture, sql: str, value: Any,
        words: str) -> None:
    caplog.set_level(logging.WARNING, logger="store.db")
    with pytest.raises(errors.ValidationError) as info:
        with api_store.db.connection() as conn:
            conn.execute(sql, (value,))
    assert words in str(info.value) and info.value.from_database
    assert_no_server_text(str(info.value))
    # The server's text is kept for the operator, in the log.
    assert any("the database refused a value" in r.getMessage() for r in caplog.records)


def test_translate_errors_keeps_psycopg_text_out_of_every_message() -> None:
    with pytest.raises(errors.ValidationError) as info:
        with translate_errors():
            raise psycopg.DataError("PostgreSQL text fields cannot contain NUL (0x00) bytes")
    assert str(info.value) == ("a string holds a NUL character, which the database cannot "
                               "store")


@pytest.fixture
def probed(api_settings: Settings, api_store: EventStore) -> Iterator[TestClient]:
    """The app with one more route that hands its query parameters to PostgreSQL unchecked,
    as a route missing a bound would: what the error handlers answer then."""
    app = create_app(api_settings, store=api_store)

    def version(v: int = Query(), group: str = Query("g")) -> dict[str, Any]:
        with api_store.db.connection() as conn:
            got = conn.execute("SELECT %s::int, %s::text", (v, group)).fetchone()
        return {"v": got[0], "group": got[1]}

    def one(v: int) -> dict[str, Any]:
        with api_store.db.connection() as conn:
            return {"v": conn.execute("SELECT %s::int", (v,)).fetchone()[0]}

    app.add_api_route("/v1/probe", version, methods=["GET"])
    app.add_api_route("/v1/probe/{v}", one, methods=["GET"])
    with TestClient(app) as c:
        yield c


def test_an_unbounded_parameter_is_a_422_naming_it_without_server_text(
        probed: TestClient) -> None:
    assert probed.get("/v1/probe", params={"v": 7}).json() == {"v": 7, "group": "g"}
    r = probed.get("/v1/probe/4294967296")
    assert r.status_code == 422
    body = r.json()["error"]
    assert body["field"] == "v" and body["message"].startswith("v: a number is out of range")
    assert_no_server_text(r.text)
    r = probed.get("/v1/probe", params={"v": 2**40, "group": "x"})
    assert r.status_code == 422
    body = r.json()["error"]
    assert "a number is out of range" in body["message"] and "v, group" in body["message"]
    assert_no_server_text(r.text)
    r = probed.get("/v1/probe", params={"v": 1, "group": "a\x00"})
    assert r.status_code == 422 and "NUL" in r.json()["error"]["message"]
    assert_no_server_text(r.text)
