"""The app's database role owns nothing: it appends and reads, and cannot switch the event
log's immutability off."""

from __future__ import annotations

import urllib.parse
import uuid

import psycopg
import pytest

from store import errors
from store.app_role import grant_app_role
from store.db import Database
from store.eventlog import EventStore
from store.settings import Settings
from tests.factories import episode_started


def _as(url: str, role: str, password: str) -> str:
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{role}:{password}@{host}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def test_the_app_role_appends_but_cannot_switch_immutability_off(
        pg_url: str, tmp_path) -> None:
    role = f"trajstore_app_{uuid.uuid4().hex[:8]}"
    admin = Database(pg_url, max_size=1)
    try:
        made = grant_app_role(admin, role, password="pw")
        assert made.created and "events" in made.tables
        assert not grant_app_role(admin, role).created  # idempotent
    finally:
        admin.close()
    url = _as(pg_url, role, "pw")  # a unix-socket URL keeps its host in the query
    store = EventStore(Database(url, max_size=2), Settings(database_url=url, data_dir=tmp_path))
    try:
        stream = f"ep-{uuid.uuid4().hex}"
        store.append(stream, [episode_started()])
        assert [r.type for r in store.read_stream(stream)] == ["episode_started"]
    finally:
        store.close()
    with psycopg.connect(url, autocommit=True) as conn:
        for statement in ("ALTER TABLE events DISABLE TRIGGER ALL",
                          "SET session_replication_role = replica",
                          "UPDATE events SET type = 'x' WHERE false",
                          "TRUNCATE events",
                          "DROP TABLE samples"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(statement)


def test_bad_role_names_are_refused(pg_url: str) -> None:
    admin = Database(pg_url, max_size=1)
    try:
        for bad in ("1abc", "pg_app", "a b", "x" * 70):
            with pytest.raises(ValueError):
                grant_app_role(admin, bad)
        with pytest.raises((errors.StoreError, ValueError)):
            grant_app_role(admin, "public")
    finally:
        admin.close()


def test_the_cli_creates_the_role(pg_url: str, tmp_path) -> None:
    import os
    import subprocess
    import sys

    role = f"trajstore_app_{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
    env.update(TRAJSTORE_DATABASE_URL=pg_url, TRAJSTORE_DATA_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "trajstore", "app-role", "--role", role,
                           "--password-stdin"], input="secret\n", env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"role {role} created" in done.stdout and "owns nothing" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "trajstore", "app-role", "--role", "pg_x"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--role" in bad.stdout + bad.stderr


def _cli(pg_url: str, tmp_path, *args: str, extra_env: dict[str, str] | None = None,
         stdin: str | None = None):  # type: ignore[no-untyped-def]
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
    env.pop("APP_DB_PASSWORD", None)
    env.update(TRAJSTORE_DATABASE_URL=pg_url, TRAJSTORE_DATA_DIR=str(tmp_path), COLUMNS="300",
               **(extra_env or {}))
    return subprocess.run([sys.executable, "-m", "trajstore", "app-role", *args], env=env,
                          input=stdin, capture_output=True, text=True, timeout=120)


def test_the_password_comes_from_an_environment_variable(pg_url: str, tmp_path) -> None:
    role = f"trajstore_app_{uuid.uuid4().hex[:8]}"
    done = _cli(pg_url, tmp_path, "--role", role, "--password-env", "APP_DB_PASSWORD",
                extra_env={"APP_DB_PASSWORD": "from-the-secret"})
    assert done.returncode == 0, done.stderr
    assert f"role {role} created" in done.stdout
    assert "from-the-secret" not in done.stdout + done.stderr
    # The role logs in with that password, and a second run sets a new one.
    with psycopg.connect(_as(pg_url, role, "from-the-secret")) as conn:
        assert conn.execute("SELECT current_user").fetchone() == (role,)
    again = _cli(pg_url, tmp_path, "--role", role, "--password-env", "ROTATED",
                 extra_env={"ROTATED": "rotated-pw"})
    assert again.returncode == 0 and "granted again" in again.stdout, again.stderr
    with psycopg.connect(_as(pg_url, role, "rotated-pw")) as conn:
        assert conn.execute("SELECT current_user").fetchone() == (role,)


@pytest.mark.parametrize(("args", "env", "stdin", "message"), [
    (["--password-env", "APP_DB_PASSWORD"], {}, None, "APP_DB_PASSWORD is not set"),
    (["--password-env", "APP_DB_PASSWORD"], {"APP_DB_PASSWORD": ""}, None,
     "APP_DB_PASSWORD is empty"),
    (["--password-env", "not a name"], {}, None, "is not an environment variable name"),
    (["--password-env", "P", "--password-stdin"], {"P": "x"}, "y\n", "not both"),
    (["--password-stdin"], {}, "\n", "must be non-empty"),
])
def test_a_missing_or_bad_password_is_refused_before_anything_changes(
        pg_url: str, tmp_path, args: list[str], env: dict[str, str], stdin: str | None,
        message: str) -> None:
    role = f"trajstore_app_{uuid.uuid4().hex[:8]}"
    done = _cli(pg_url, tmp_path, "--role", role, *args, extra_env=env, stdin=stdin)
    assert done.returncode == 2, (done.stdout, done.stderr)
    out = " ".join((done.stdout + done.stderr).replace("│", " ").split())
    assert message in out and ("--password-env" in out or "--password-stdin" in out)
    with psycopg.connect(pg_url) as conn:
        assert conn.execute("SELECT count(*) FROM pg_roles WHERE rolname = %s",
                            (role,)).fetchone() == (0,)


def test_the_app_role_rebuilds_projections_and_records_conflicts(fresh_db: str,
                                                                  tmp_path) -> None:
    """What docs/deploy.md says the services' role may do: the replay's writes, a rebuild
    (deletes only) and the conflict records of leased samples."""
    from store import migrate
    from store.leasing import Leasing
    from store.projections import Projections
    from tests.store.test_leasing import add_group, new_run
    from tests.store.test_projection_conflicts import _projection

    migrate.upgrade(fresh_db)
    role = f"trajstore_app_{uuid.uuid4().hex[:8]}"
    admin = Database(fresh_db, max_size=1)
    try:
        grant_app_role(admin, role, password="pw")
    finally:
        admin.close()
    url = _as(fresh_db, role, "pw")
    store = EventStore(Database(url, max_size=2), Settings(database_url=url, data_dir=tmp_path))
    try:
        run = new_run()
        add_group(store, run, "g", episodes=2, size=2)
        lease = Leasing(store).lease_batch(run, groups=1, lease_seconds=60)
        assert lease is not None
        projections = Projections(store)
        assert projections.rebuild() == 2
        assert projections.conflict_count() == 0
        episode = lease.samples[0].episode_id
        assert projections.write(_projection(store, episode, version=9, samples_from=[]))
        (conflict,) = projections.conflicts(episode_id=episode)
        assert conflict["action"] == "delete" and conflict["sample_status"] == "leased"
    finally:
        store.close()
