"""The views stay index walks as the log grows: on a store of 1M events (100k episodes over
200 runs, with their projection rows), EXPLAIN shows every view narrowed by run, and by a
recent time window, reading only through indexes.

The rows are generated in the database with ``generate_series``; events are inserted
directly (appending 1M events through the store would take far longer than the plans need).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from store import analytics, migrate
from tests.conftest import PostgresServer

EPISODES = 100_000
RUNS = 200
EVENTS_PER_EPISODE = 10
BIG_TABLES = {"events", "episodes", "failures", "tool_calls", "samples", "timeline_forks"}

FILL = f"""
SET LOCAL synchronous_commit = off;
INSERT INTO runs (run_id, project, group_size, max_negatives_per_group, save_negative_samples,
                  config, created_at)
SELECT 'run-' || r, 'bench', 8, 1, true, '{{"rollback": {{"max_tool_retries": 3}}}}',
       timestamptz '2026-01-01'
FROM generate_series(0, {RUNS - 1}) r;

INSERT INTO events (event_id, stream_id, stream_version, type, schema_version, run_id,
                    group_id, data, occurred_at)
SELECT gen_random_uuid(), 'ep-' || (n / {EVENTS_PER_EPISODE}), n % {EVENTS_PER_EPISODE} + 1,
       (ARRAY['episode_started', 'llm_called', 'checkpoint_created', 'tool_returned',
              'attempt_failed', 'llm_called', 'rolled_back', 'tool_returned',
              'reward_assigned', 'episode_finished'])[n % {EVENTS_PER_EPISODE} + 1],
       1, 'run-' || (n / {EVENTS_PER_EPISODE}) % {RUNS}, 'g' || (n / {EVENTS_PER_EPISODE} / 8),
       '{{}}', timestamptz '2026-01-01' + (n / {EVENTS_PER_EPISODE}) * interval '1 second'
FROM generate_series(0, {EPISODES * EVENTS_PER_EPISODE - 1}) n;

INSERT INTO episodes (episode_id, run_id, group_id, status, reward, policy_version, llm_calls,
                      tool_calls, tool_errors, attempts_failed, rollbacks, timelines,
                      survivors, forks, drifted_messages, negatives, tokens, started_at,
                      finished_at, projected_version)
SELECT 'ep-' || i, 'run-' || i % {RUNS}, 'g' || i / 8,
       (ARRAY['completed', 'completed', 'terminated', 'truncated', 'invalid'])[i % 5 + 1],
       (i % 3) / 2.0, i / 20000, 3, 3, 1, i % 2, i % 3, 3, 2, 1, i % 2, i % 2, 100 + i % 50,
       timestamptz '2026-01-01' + i * interval '1 second',
       timestamptz '2026-01-01' + i * interval '1 second' + interval '1 minute', 10
FROM generate_series(0, {EPISODES - 1}) i;

INSERT INTO tool_calls (episode_id, stream_version, run_id, group_id, agent, policy_version,
                        tool_name, is_error, error_type, position_key, duration_ms,
                        occurred_at)
SELECT 'ep-' || i, 4 + k, 'run-' || i % {RUNS}, 'g' || i / 8, 'main', i / 20000,
       (ARRAY['search', 'calc', 'shell'])[k + 1], k = 0 AND i % 2 = 0,
       CASE WHEN k = 0 AND i % 2 = 0 THEN 'TypeError' END, 'turn_1', 10.0,
       timestamptz '2026-01-01' + i * interval '1 second'
FROM generate_series(0, {EPISODES - 1}) i, generate_series(0, 2) k;

INSERT INTO failures (run_id, group_id, episode_id, agent, policy_version, source,
                      stream_version, tool_name, error_type, error_message, position_key,
                      retry_index, recovered, occurred_at, retried, retries_to_recover)
SELECT 'run-' || i % {RUNS}, 'g' || i / 8, 'ep-' || i, 'main', i / 20000,
       (ARRAY['tool', 'attempt'])[k + 1], 4 + k, 'search', 'TypeError',
       'TypeError: unexpected argument ''q' || i % 7 || ''' at /srv/search.py:' || i % 100,
       'turn_1', 0, i % 3 > 0, timestamptz '2026-01-01' + i * interval '1 second',
       i % 3 > 0, CASE WHEN i % 3 = 1 THEN 1 END
FROM generate_series(0, {EPISODES - 1}) i, generate_series(0, 1) k
WHERE i % 2 = 0;

INSERT INTO timeline_forks (episode_id, agent, timeline, other, message_index, reason)
SELECT 'ep-' || i, 'main', 2, 1, 1, (ARRAY['content', 'tool_calls', 'token_drift'])[i % 3 + 1]
FROM generate_series(0, {EPISODES - 1}) i;

INSERT INTO samples (run_id, group_id, episode_id, agent, kind, timeline_index, reward,
                     policy_version, prompt_length, num_tokens, num_trainable, token_ids,
                     loss_mask, logprobs, status)
SELECT 'run-' || i % {RUNS}, 'g' || i / 8, 'ep-' || i, 'main',
       (ARRAY['positive', 'positive', 'negative'])[k + 1], k, 1.0, i / 20000, 10, 20, 10,
       '\\x00', '\\x01', '\\x00', 'ready'
FROM generate_series(0, {EPISODES - 1}) i, generate_series(0, 2) k;
"""


@pytest.fixture(scope="module")
def big_store(pg_server: PostgresServer) -> Iterator[str]:
    url = pg_server.create_database("trajstore_plans")
    migrate.upgrade(url)
    with psycopg.connect(url) as conn:
        conn.execute(FILL)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
    yield url
    pg_server.drop_database(url)


def plan_nodes(conn: psycopg.Connection, statement: str,
               params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every node of the plan of ``statement`` (with ``params`` bound as store.analytics
    binds them: an unprepared statement)."""
    (plan,) = conn.execute(f"EXPLAIN (FORMAT JSON) {statement}", params,
                           prepare=False).fetchone()
    if isinstance(plan, str):
        plan = json.loads(plan)
    nodes, todo = [], [plan[0]["Plan"]]
    while todo:
        node = todo.pop()
        nodes.append(node)
        todo.extend(node.get("Plans", []))
    return nodes


def scans(nodes: list[dict[str, Any]]) -> tuple[set[str], set[str]]:
    """(index names used, tables read by a sequential scan)."""
    indexes = {n["Index Name"] for n in nodes if "Index Name" in n}
    sequential = {n["Relation Name"] for n in nodes if n["Node Type"] == "Seq Scan"}
    return indexes, sequential


# For each view narrowed to one run: the indexes its plan must walk. Episodes may be reached
# through either index that leads with run_id.
BY_RUN = {
    "failure_patterns": [{"failures_run_idx"}, {"tool_calls_run_idx"}],
    "rollback_outcomes": [{"episodes_run_version_idx", "episodes_run_group_idx"},
                          {"failures_key"}],
    "tool_error_rates": [{"tool_calls_run_idx"}, {"failures_run_idx"}],
    "episode_outcomes": [{"episodes_run_version_idx", "episodes_run_group_idx"}],
    "timeline_stats": [{"episodes_run_version_idx", "episodes_run_group_idx"},
                       {"timeline_forks_pkey"}],
    "negative_sample_stats": [{"samples_run_group_idx"}],
    "error_signatures": [{"failures_run_idx"}],
}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_plans_use_indexes_on_a_million_events(big_store: str) -> None:
    with psycopg.connect(big_store) as conn:
        assert conn.execute("SELECT count(*) FROM events").fetchone() == (1_000_000,)
        assert {v.view for v in analytics.VIEWS.values()} == set(BY_RUN)
        for spec in analytics.VIEWS.values():
            for statement in (f"SELECT * FROM {spec.view} WHERE run_id = 'run-18'",
                              f"SELECT * FROM {spec.function}(run => 'run-18', min_version => 1,"
                              " since => timestamptz '2026-01-01')"):
                indexes, sequential = scans(plan_nodes(conn, statement))
                assert not sequential & BIG_TABLES, (statement, sequential)
                for choices in BY_RUN[spec.view]:
                    assert indexes & choices, (statement, choices, indexes)
                rows = conn.execute(statement).fetchall()
                assert rows, statement
        # No run, a recent window (a bound parameter, as store.analytics sends it): the
        # episodes are found by finished_at.
        recent = {"since": dt.datetime(2026, 1, 1, tzinfo=dt.UTC) + dt.timedelta(seconds=99950)}
        for function in ("analytics_episode_outcomes", "analytics_rollback_outcomes",
                         "analytics_timeline_stats", "analytics_failure_patterns"):
            statement = f"SELECT * FROM {function}(since => %(since)s)"
            indexes, sequential = scans(plan_nodes(conn, statement, recent))
            assert "episodes_finished_at_idx" in indexes, (statement, indexes)
            assert not sequential & BIG_TABLES, (statement, sequential)
            assert conn.execute(statement, recent).fetchall(), statement
