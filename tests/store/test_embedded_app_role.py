"""The embedded default connects as the non-owner application role: migrations run as the
server's owner, the processes as ``trajstore_app``, which is no superuser, owns nothing and
cannot drop, update or delete the events table (real pgserver PostgreSQL)."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from store import embedded, migrate
from store.eventlog import EventStore
from store.settings import Settings
from tests.store.test_cli_embedded import _env, _run


@pytest.mark.timeout(400)
def test_embedded_default_uses_the_app_role(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, database_url=None, redis_url=None)
    store = EventStore.open(settings)  # starts, migrates (as owner), connects as the role
    try:
        url = embedded.database_url(settings)
        assert migrate.current_revision(url) == migrate.head_revision()
        with psycopg.connect(url, autocommit=True) as conn:
            user, superuser = conn.execute(
                "SELECT current_user, rolsuper FROM pg_roles WHERE rolname = current_user"
            ).fetchone()  # type: ignore[misc]
            assert user == embedded.APP_ROLE and superuser is False
            with store.db.connection() as pooled:
                row = pooled.execute("SELECT current_user").fetchone()
                assert row is not None and row[0] == embedded.APP_ROLE
            for statement in ("DROP TABLE events", "DELETE FROM events",
                              "TRUNCATE events", "ALTER TABLE events DISABLE TRIGGER ALL",
                              "SET session_replication_role = replica"):
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    conn.execute(statement)
        # The owner still migrates (and the CLI's migrate takes the owner's URL).
        owner = embedded.owner_database_url(settings)
        with psycopg.connect(owner) as conn:
            row = conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user"
                               ).fetchone()
            assert row is not None and row[0] is True
    finally:
        store.close()
        embedded.stop_embedded_postgres(settings)


@pytest.mark.timeout(400)
def test_cli_migrate_and_example_on_the_embedded_default(tmp_path: Path) -> None:
    env = _env(TRAJSTORE_DATA_DIR=str(tmp_path))
    migrated = _run(["migrate"], env)
    assert migrated.returncode == 0, migrated.stderr
    sample = _run(["example", "--seed", "1"], env)
    assert sample.returncode == 0, sample.stderr
    status = _run(["status"], env)
    assert status.returncode == 0, status.stderr
    assert "trajstore_app" in status.stdout and "llm_called" in status.stdout
    # Steps that create roles take the embedded server's owner, not the app role.
    for args in (["app-role"], ["analytics", "grant", "--role", "reader_embedded"]):
        done = _run(args, env)
        assert done.returncode == 0, done.stdout + done.stderr
