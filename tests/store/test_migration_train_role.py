"""Migration 0013: ``api_keys`` takes the role ``train``; going back refuses while a train key
exists (naming how many) instead of dropping it, and works once none does."""

from __future__ import annotations

import psycopg
import pytest

from store import migrate
from tests.conftest import PostgresServer


def _key(conn: psycopg.Connection, key_id: str, role: str) -> None:
    conn.execute("INSERT INTO api_keys (key_id, project, role, secret_hash, salt, hash_params)"
                 " VALUES (%s, 'p', %s, 'x', 'y', 'scrypt$2$1$1')", (key_id, role))


def test_the_train_role_comes_and_goes(pg_server: PostgresServer) -> None:
    url = pg_server.create_database("trajstore_migration_0013")
    migrate.upgrade(url, "0012")
    with psycopg.connect(url, autocommit=True) as conn:
        _key(conn, "a", "read")
        with pytest.raises(psycopg.errors.CheckViolation):
            _key(conn, "t", "train")
    migrate.upgrade(url, "head")
    with psycopg.connect(url, autocommit=True) as conn:
        _key(conn, "t", "train")
        with pytest.raises(psycopg.errors.CheckViolation):
            _key(conn, "o", "owner")
    with pytest.raises(Exception, match="1 API key\\(s\\) have the role train"):
        migrate.downgrade(url, "0012")
    with psycopg.connect(url, autocommit=True) as conn:
        roles = conn.execute("SELECT key_id, role FROM api_keys ORDER BY key_id").fetchall()
        assert roles == [("a", "read"), ("t", "train")]
        conn.execute("DELETE FROM api_keys WHERE role = 'train'")
    migrate.downgrade(url, "0012")
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute("SELECT role FROM api_keys").fetchall() == [("read",)]
    pg_server.drop_database(url)
