"""Migration 0012: samples of an unrewarded episode projected before it stop being ready (they
wait as ``no_reward``), the exclusions view names such an episode ``no_reward``, and both go
back on downgrade."""

from __future__ import annotations

import psycopg

from store import migrate
from tests.conftest import PostgresServer


def _project(conn: psycopg.Connection, episode: str, reward: float | None) -> None:
    """An episode row and one ready positive sample, as a projection before 0012 wrote them."""
    conn.execute("INSERT INTO episodes (episode_id, run_id, group_id, status, reward,"
                 " projected_version) VALUES (%s, 'r', 'g', 'completed', %s, 4)",
                 (episode, reward))
    conn.execute("INSERT INTO samples (run_id, group_id, episode_id, agent, kind,"
                 " timeline_index, reward, prompt_length, num_tokens, num_trainable,"
                 " token_ids, loss_mask, logprobs) VALUES ('r', 'g', %s, 'main', 'positive',"
                 " 0, %s, 1, 2, 1, %s, %s, %s)",
                 (episode, reward, b"\x01\x00\x00\x00\x02\x00\x00\x00", b"\x00\x01",
                  b"\x00" * 8))


def _state(url: str) -> tuple[dict[str, str], list[tuple[str, str]]]:
    with psycopg.connect(url) as conn:
        statuses = dict(conn.execute("SELECT episode_id, status FROM samples").fetchall())
        excluded = conn.execute("SELECT episode_id, category FROM exclusions"
                                " ORDER BY episode_id").fetchall()
    return statuses, excluded


def test_unrewarded_samples_wait_and_are_excluded_as_no_reward(pg_server: PostgresServer
                                                               ) -> None:
    url = pg_server.create_database("trajstore_migration_0012")
    migrate.upgrade(url, "0011")
    with psycopg.connect(url, autocommit=True) as conn:
        _project(conn, "scored", 1.0)
        _project(conn, "waiting", None)
    assert _state(url) == ({"scored": "ready", "waiting": "ready"}, [])

    migrate.upgrade(url, "head")
    assert _state(url) == ({"scored": "ready", "waiting": "no_reward"},
                           [("waiting", "no_reward")])

    migrate.downgrade(url, "0011")
    assert _state(url) == ({"scored": "ready", "waiting": "ready"}, [])
    pg_server.drop_database(url)
