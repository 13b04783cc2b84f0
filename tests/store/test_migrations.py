"""Migrations: upgrade, downgrade, upgrade again on an empty database; the events table they
make refuses every change to a stored event."""

from __future__ import annotations

import uuid

import psycopg
import pytest

from store import errors, migrate
from store.eventlog import EventStore
from tests.factories import episode_started


def _tables(url: str) -> set[str]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public'"
        ).fetchall()
    return {r[0] for r in rows}


def test_upgrade_downgrade_upgrade(fresh_db: str) -> None:
    assert migrate.current_revision(fresh_db) is None
    migrate.upgrade(fresh_db)
    assert migrate.current_revision(fresh_db) == migrate.head_revision()
    assert "events" in _tables(fresh_db)
    migrate.downgrade(fresh_db)
    assert migrate.current_revision(fresh_db) is None
    assert "events" not in _tables(fresh_db)
    migrate.upgrade(fresh_db)
    assert migrate.current_revision(fresh_db) == migrate.head_revision()
    migrate.upgrade(fresh_db)  # idempotent
    with psycopg.connect(fresh_db) as conn:
        storage = dict(conn.execute(
            "SELECT attname, attstorage FROM pg_attribute WHERE attrelid = 'events'::regclass"
            " AND attname IN ('prompt_ids', 'response_ids', 'logprobs')"
        ).fetchall())
    assert storage == {"prompt_ids": "e", "response_ids": "e", "logprobs": "e"}


def test_bad_url_is_named() -> None:
    with pytest.raises(ValueError, match="not a PostgreSQL URL"):
        migrate.sqlalchemy_url("mysql://x/y")


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE events SET type = 'x' WHERE position = (SELECT min(position) FROM events)",
        "DELETE FROM events WHERE position = (SELECT min(position) FROM events)",
        "TRUNCATE events",
    ],
)
def test_events_are_immutable_whatever_the_client(store: EventStore, pg_url: str,
                                                   statement: str) -> None:
    store.append(f"ep-{uuid.uuid4().hex}", [episode_started()])
    before = store.counts_by_type()
    with psycopg.connect(pg_url) as conn:  # a plain client, superuser, not the store API
        with pytest.raises(psycopg.Error, match="immutable"):
            conn.execute(statement)
    with pytest.raises(errors.RefusedError), store.db.transaction() as conn:
        conn.execute(statement)
    assert store.counts_by_type() == before
