"""Migrations: upgrade, downgrade, upgrade again on an empty database."""

from __future__ import annotations

import psycopg

from store import migrate


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
    import pytest

    with pytest.raises(ValueError, match="not a PostgreSQL URL"):
        migrate.sqlalchemy_url("mysql://x/y")
