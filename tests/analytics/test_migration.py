"""Migration 0005 on a store that already holds projections: signatures of existing failures,
episodes marked for replay and re-projected with tool calls, and the way back down."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg

from store import migrate
from store.db import Database
from store.error_signature import error_signature
from store.eventlog import NO_STREAM, EventStore, run_stream_id
from store.events import RunConfig, RunCreated
from store.projections import Projections
from store.settings import Settings
from tests.analytics.conftest import EPISODES, RUN
from tests.analytics.seed import record_events
from tests.conftest import PostgresServer
from workers.replay.jobs.project import project_episode

ANALYTICS_RELATIONS = ("tool_calls", "failure_patterns", "rollback_outcomes",
                       "tool_error_rates", "episode_outcomes", "timeline_stats",
                       "negative_sample_stats", "error_signatures")


def relations(url: str) -> set[str]:
    with psycopg.connect(url) as conn:
        return {r[0] for r in conn.execute(
            "SELECT relname FROM pg_class WHERE relnamespace = 'public'::regnamespace")}


def test_upgrade_over_existing_projections_and_back(pg_server: PostgresServer, qwen3: Any,
                                                    tmp_path: Path) -> None:
    url = pg_server.create_database("trajstore_migration")
    try:
        migrate.upgrade(url, "0004")
        assert not set(ANALYTICS_RELATIONS) & relations(url)
        store = EventStore(Database(url, max_size=2), Settings(database_url=url,
                                                               data_dir=tmp_path))
        try:
            store.append(run_stream_id(RUN),
                         [RunCreated(run_id=RUN, config=RunConfig(tokenizer="qwen3"))],
                         NO_STREAM)
            events = record_events(qwen3, EPISODES["e2"])
            store.append("old-episode", events, NO_STREAM)
            message = "TypeError: unexpected argument 'q2' at /srv/tools/search.py:17"
            with store.db.transaction() as conn:
                # A projection as the code before 0005 wrote it.
                conn.execute(
                    "INSERT INTO episodes (episode_id, run_id, group_id, status,"
                    " projected_version) VALUES ('old-episode', %s, 'g1', 'completed', %s)",
                    (RUN, len(events)))
                conn.execute(
                    "INSERT INTO failures (run_id, group_id, episode_id, agent, source,"
                    " stream_version, error_message) VALUES (%s, 'g1', 'old-episode', 'main',"
                    " 'tool', 4, %s)", (RUN, message))
            assert Projections(store).finished_unprojected() == []

            migrate.upgrade(url)
            assert set(ANALYTICS_RELATIONS) <= relations(url)
            with store.db.connection() as conn:
                row = conn.execute("SELECT error_signature, retried, retries_to_recover"
                                   " FROM failures").fetchone()
                assert row == (error_signature(message), False, None)
            # The episode is replayed again, and this time gets its tool calls and retries.
            assert Projections(store).finished_unprojected() == ["old-episode"]
            assert project_episode(store, "old-episode").outcome == "written"
            with store.db.connection() as conn:
                assert conn.execute("SELECT count(*) FROM tool_calls").fetchone() == (3,)
                assert conn.execute(
                    "SELECT retries_to_recover FROM failures WHERE source = 'tool'"
                    " ORDER BY stream_version").fetchall() == [(2,), (1,)]

            migrate.downgrade(url, "0004")
            assert not set(ANALYTICS_RELATIONS) & relations(url)
            with psycopg.connect(url) as conn:
                columns = {r[0] for r in conn.execute(
                    "SELECT attname FROM pg_attribute WHERE attrelid = 'failures'::regclass")}
                assert not {"error_signature", "retried", "retries_to_recover"} & columns
                assert conn.execute("SELECT count(*) FROM pg_proc WHERE proname LIKE"
                                    " 'analytics\\_%' OR proname = 'trajstore_error_signature'"
                                    ).fetchone() == (0,)
            migrate.upgrade(url)
            assert set(ANALYTICS_RELATIONS) <= relations(url)
        finally:
            store.close()
    finally:
        pg_server.drop_database(url)
