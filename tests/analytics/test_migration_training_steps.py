"""Migration 0011: ``training_steps`` gains the step's negative samples and EGPO bonus, keeps
the privileges an analyst role holds on the view, and goes back down the same way."""

from __future__ import annotations

import uuid
from pathlib import Path

import psycopg

from store import migrate
from store.db import Database
from store.eventlog import NO_STREAM, EventStore, run_stream_id
from store.events import PolicyUpdated, RunConfig, RunCreated
from store.settings import Settings
from store.training_steps import training_steps
from tests.conftest import PostgresServer

NEW = ("negatives", "egpo_bonus_mean", "egpo_bonus_frac")


def _columns(url: str) -> list[str]:
    with psycopg.connect(url) as conn:
        return [r[0] for r in conn.execute(
            "SELECT column_name FROM information_schema.columns "
            "WHERE table_name = 'training_steps' ORDER BY ordinal_position")]


def _grantees(url: str) -> set[str]:
    with psycopg.connect(url) as conn:
        return {r[0] for r in conn.execute(
            "SELECT grantee FROM information_schema.role_table_grants "
            "WHERE table_name = 'training_steps' AND privilege_type = 'SELECT'")}


def test_training_steps_gain_negatives_and_bonus_and_keep_grants(
        pg_server: PostgresServer, tmp_path: Path) -> None:
    url = pg_server.create_database("trajstore_migration_0011")
    role = f"analyst_{uuid.uuid4().hex[:8]}"
    try:
        migrate.upgrade(url, "0010")
        assert not set(NEW) & set(_columns(url))
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f'CREATE ROLE "{role}" NOLOGIN')
            conn.execute(f'GRANT SELECT ON training_steps TO "{role}"')
        store = EventStore(Database(url, max_size=2), Settings(database_url=url,
                                                               data_dir=tmp_path))
        try:
            store.append(run_stream_id("r"), [
                RunCreated(run_id="r", config=RunConfig()),
                PolicyUpdated(version=1, step=0, metrics={"samples": 40.0, "negatives": 7.0,
                                                          "egpo_bonus_mean": 0.125,
                                                          "egpo_bonus_frac": 0.5}),
                PolicyUpdated(version=2, step=1, metrics={"samples": 32.0}),
            ], NO_STREAM)
            migrate.upgrade(url, "head")
            columns = _columns(url)
            assert columns[-3:] == list(NEW)
            assert role in _grantees(url)
            newest, first = training_steps(store.db, "r")
            assert (first.negatives, first.egpo_bonus_mean, first.egpo_bonus_frac) == (
                7, 0.125, 0.5)
            assert first.samples == 40
            # A step that recorded none of them (GRPO, an older trainer): NULL, not 0.
            assert (newest.negatives, newest.egpo_bonus_mean) == (None, None)

            migrate.downgrade(url, "0010")
            assert not set(NEW) & set(_columns(url))
            assert columns[:-3] == _columns(url)
            assert role in _grantees(url)
        finally:
            store.db.close()
    finally:
        # The role's privileges go with it (the fixture drops the database).
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f'DROP OWNED BY "{role}"')
        with psycopg.connect(pg_server.admin_url, autocommit=True) as conn:
            conn.execute(f'DROP ROLE "{role}"')
