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
