"""The analysts' read-only role: it reads the views and projections, and every write fails
(connected as that role, through SET ROLE and through its own login)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import errors as pg_errors

from store import analytics, errors, migrate
from store.analyst_role import grant_read_only, read_only_violations
from store.db import Database
from store.settings import Settings
from tests.analytics.conftest import RUN, Seeded
from tests.conftest import PostgresServer

WRITES = [
    "INSERT INTO events (event_id, stream_id, stream_version, type, schema_version, data)"
    " VALUES (gen_random_uuid(), 'x', 1, 'episode_started', 1, '{}')",
    "UPDATE episodes SET reward = 5",
    "DELETE FROM failures",
    "TRUNCATE samples",
    "INSERT INTO tool_calls SELECT * FROM tool_calls LIMIT 1",
    "UPDATE leases SET ended = 'acked'",
    "CREATE TABLE scratch (x int)",
    "CREATE VIEW scratch_view AS SELECT 1",
]
NOT_READABLE = ["events", "api_keys", "leases", "projection_checkpoints"]


def role_name() -> str:
    return f"analyst_{uuid.uuid4().hex[:10]}"


@pytest.fixture
def roles(seeded: Seeded) -> Iterator[list[str]]:
    """Names of roles the test creates; dropped afterwards."""
    created: list[str] = []
    yield created
    with psycopg.connect(seeded.url, autocommit=True) as conn:
        for name in created:
            if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (name,)).fetchone():
                conn.execute(f'DROP OWNED BY "{name}"')
                conn.execute(f'DROP ROLE "{name}"')


def as_role(url: str, role: str, password: str | None = None) -> psycopg.Connection:
    params = psycopg.conninfo.conninfo_to_dict(url)
    params.update(user=role, password=password or "")
    return psycopg.connect(**params, autocommit=True)  # type: ignore[arg-type]


def test_nologin_role_reads_views_and_writes_nothing(seeded: Seeded, roles: list[str]) -> None:
    role = role_name()
    roles.append(role)
    done = grant_read_only(seeded.db, role=role)
    assert done.created and not done.login
    assert set(done.relations) == ({v.view for v in analytics.VIEWS.values()}
                                   | set(analytics.PROJECTION_TABLES))
    with psycopg.connect(seeded.url, autocommit=True) as conn:
        conn.execute(f'SET ROLE "{role}"')
        rows = conn.execute("SELECT failures FROM failure_patterns WHERE run_id = %s"
                            " ORDER BY failures DESC", (RUN,)).fetchall()
        assert [r[0] for r in rows] == [4, 3, 1, 1]
        assert conn.execute("SELECT count(*) FROM analytics_rollback_outcomes(run => %s)",
                            (RUN,)).fetchone() == (2,)
        for table in analytics.PROJECTION_TABLES:
            conn.execute(f"SELECT count(*) FROM {table}")
        for statement in WRITES:
            with pytest.raises(pg_errors.InsufficientPrivilege):
                conn.execute(statement)
        for table in NOT_READABLE:
            with pytest.raises(pg_errors.InsufficientPrivilege):
                conn.execute(f"SELECT count(*) FROM {table}")
    with seeded.db.connection() as conn:
        assert read_only_violations(conn, role) == []
        assert conn.execute("SELECT count(*) FROM episodes WHERE reward = 5").fetchone() == (0,)


def test_login_role_sessions_are_read_only_and_privileges_hold(seeded: Seeded,
                                                               roles: list[str]) -> None:
    role = role_name()
    roles.append(role)
    done = grant_read_only(seeded.db, role=role, login=True, password="s3cret-pass")
    assert done.login
    with as_role(seeded.url, role, "s3cret-pass") as conn:
        assert conn.execute("SHOW default_transaction_read_only").fetchone() == ("on",)
        rows = conn.execute("SELECT tool_name, calls FROM tool_error_rates WHERE run_id = %s"
                            " ORDER BY policy_version, tool_name", (RUN,)).fetchall()
        assert rows == [("calc", 5), ("search", 6), ("calc", 1), ("search", 2)]
        with pytest.raises(pg_errors.ReadOnlySqlTransaction):
            conn.execute(WRITES[0])
        # Turning the session setting off does not help: the privileges refuse too.
        conn.execute("SET default_transaction_read_only = off")
        for statement in WRITES:
            with pytest.raises(pg_errors.InsufficientPrivilege):
                conn.execute(statement)


def test_grant_is_idempotent_and_can_add_login(seeded: Seeded, roles: list[str]) -> None:
    role = role_name()
    roles.append(role)
    assert grant_read_only(seeded.db, role=role).created
    again = grant_read_only(seeded.db, role=role)
    assert not again.created and not again.login
    assert grant_read_only(seeded.db, role=role, login=True).login


def test_roles_that_can_write_are_refused(seeded: Seeded, roles: list[str]) -> None:
    with pytest.raises(errors.RefusedError, match="exists and can write.*SUPER"):
        grant_read_only(seeded.db, role="postgres")
    writer = role_name()
    roles.append(writer)
    with seeded.db.transaction() as conn:
        conn.execute(f'CREATE ROLE "{writer}"')
        conn.execute(f'GRANT INSERT ON episodes TO "{writer}"')
    with pytest.raises(errors.RefusedError, match="INSERT on episodes"):
        grant_read_only(seeded.db, role=writer)
    member = role_name()
    roles.append(member)
    with seeded.db.transaction() as conn:
        conn.execute(f'CREATE ROLE "{member}" IN ROLE "{writer}"')
    with pytest.raises(errors.RefusedError, match=f"member of {writer}"):
        grant_read_only(seeded.db, role=member)


def test_write_privileges_granted_to_public_roll_the_grant_back(
    pg_server: PostgresServer,
) -> None:
    url = pg_server.create_database("trajstore_role")
    migrate.upgrade(url)
    role = role_name()
    db = Database(url, max_size=1)
    try:
        with db.transaction() as conn:
            conn.execute("GRANT UPDATE ON leases TO PUBLIC")
        with pytest.raises(errors.RefusedError, match="UPDATE on leases.*PUBLIC"):
            grant_read_only(db, role=role)
        with db.connection() as conn:
            assert conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s",
                                (role,)).fetchone() is None
    finally:
        db.close()
        pg_server.drop_database(url)


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"role": "1abc"}, ValueError, "role must be 1-63 letters"),
    ({"role": "a-b"}, ValueError, "role must be 1-63 letters"),
    ({"role": ""}, ValueError, "role must be 1-63 letters"),
    ({"role": "x" * 64}, ValueError, "role must be 1-63 letters"),
    ({"role": "pg_reader"}, ValueError, "reserved"),
    ({"role": "PUBLIC"}, ValueError, "reserved"),
    ({"role": 5}, TypeError, "role must be a str, got int"),
    ({"role": "ok_name", "password": "pw"}, ValueError, "password is only for a role that "
     "can log in"),
    ({"role": "ok_name", "login": True, "password": ""}, ValueError, "password must not be "
     "empty"),
    ({"role": "ok_name", "login": "yes"}, TypeError, "login must be a bool"),
])
def test_bad_arguments(seeded: Seeded, kwargs: dict, error: type[Exception],
                       message: str) -> None:
    with pytest.raises(error, match=message):
        grant_read_only(seeded.db, **kwargs)
    with seeded.db.connection() as conn:
        assert conn.execute("SELECT 1 FROM pg_roles WHERE rolname = 'ok_name'").fetchone() \
            is None


def test_an_analysts_notify_changes_nothing(seeded: Seeded, roles: list[str],
                                            tmp_path: Path) -> None:
    """PostgreSQL has no privilege for NOTIFY: the analyst role can send one on any channel.
    A forged key-revocation notice is checked against the key's row, so the key an API
    process trusts stays trusted (and its remembered right secret stays remembered); a real
    revocation is still heard at once."""
    from api.keys import REVOKED_CHANNEL, KeyStore

    role = role_name()
    roles.append(role)
    grant_read_only(seeded.db, role=role, login=True, password="s3cret-pass")
    keys = KeyStore(seeded.db, Settings(database_url=seeded.url, data_dir=tmp_path,
                                        api_key_scrypt_n=1024, api_key_cache_s=60))
    try:
        made = keys.create(project="default", role="read")
        deadline = time.monotonic() + 10
        while keys.trusted(made.token) is None and time.monotonic() < deadline:
            assert keys.verify(made.token) is not None
            time.sleep(0.1)
        assert keys.trusted(made.token) is not None  # listening, and trusted from memory
        with as_role(seeded.url, role, "s3cret-pass") as conn:
            conn.execute(f"NOTIFY {REVOKED_CHANNEL}, '{made.key.key_id}'")
            conn.execute("SELECT pg_notify(%s, %s)", (REVOKED_CHANNEL, made.key.key_id))
            conn.execute("NOTIFY trajstore_events")
        time.sleep(2.5)  # the listener waits up to 1 s per round
        assert keys.trusted(made.token) is not None
        keys.revoke(made.key.key_id)
        deadline = time.monotonic() + 10
        while keys.trusted(made.token) is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert keys.trusted(made.token) is None
        assert keys.verify(made.token) is None
    finally:
        keys.close()
