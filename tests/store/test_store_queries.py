"""The read queries that moved behind the store (sweep, demo table, readiness): what they
return for a replayed episode, and what they do with bad input."""

from __future__ import annotations

import time
import uuid

import pytest

from store import queries
from store.eventlog import NO_STREAM, EventStore
from tests.factories import episode_started
from tests.replay.replay_tokenizers import qwen3_tokenizer
from tests.workers.test_replay_pipeline import new_run, rollback_episode
from workers.replay.jobs.project import project_episode


def test_version_summaries_and_failures_of_a_replayed_episode(store: EventStore) -> None:
    run_id = new_run(store)
    episode = f"ep-{uuid.uuid4().hex}"
    store.append(episode, rollback_episode(qwen3_tokenizer(), run_id, "g1"), NO_STREAM)
    assert queries.episodes_done(store, run_id, 0) == 0  # not replayed yet
    assert project_episode(store, episode).outcome == "written"
    [summary] = queries.version_summaries(store, run_id)
    assert (summary.version, summary.episodes, summary.reward_mean) == (0, 1, 1.0)
    assert summary.rollbacks == 1 and summary.tool_errors == 1
    # the failing tool result and the failed attempt it caused
    assert queries.failures_by_version(store, run_id) == {0: {"TypeError": 2}}
    assert queries.episodes_done(store, run_id, 0) == 1
    assert queries.episodes_done(store, run_id, 1) == 0
    assert queries.episodes_done(store, run_id) == 1  # every version


def test_unknown_run_has_no_rows(store: EventStore) -> None:
    assert queries.version_summaries(store, "no-such-run") == []
    assert queries.failures_by_version(store, "no-such-run") == {}
    assert queries.episodes_done(store, "no-such-run", 0) == 0


def test_stale_episodes(store: EventStore) -> None:
    open_episode = f"ep-{uuid.uuid4().hex}"
    version = store.append(open_episode, [episode_started()], NO_STREAM).version
    time.sleep(0.05)
    stale = dict(queries.stale_episodes(store, timeout_s=0.01, limit=100_000))
    assert stale[open_episode] == version
    assert open_episode not in dict(queries.stale_episodes(store, timeout_s=3600))
    with pytest.raises(ValueError, match="timeout_s"):
        queries.stale_episodes(store, timeout_s=0)
    with pytest.raises(ValueError, match="limit"):
        queries.stale_episodes(store, timeout_s=1, limit=0)


def test_ping(store: EventStore) -> None:
    queries.ping(store)  # raises when the database does not answer


def test_the_example_episode_replays_into_samples(store: EventStore) -> None:
    from store.example_episode import record_example_episode
    from workers.engines.tokenizers import load_tokenizer

    run_id, episode = record_example_episode(
        store, seed=4, run_id=f"example-{uuid.uuid4().hex[:8]}",
        tokenizer=load_tokenizer("qwen3"), tokenizer_name="qwen3")
    outcome = project_episode(store, episode)
    assert outcome.outcome == "written" and outcome.status == "completed", outcome
    with store.db.connection() as conn:
        kinds = conn.execute("SELECT kind, num_trainable FROM samples WHERE episode_id = %s",
                             (episode,)).fetchall()
    assert kinds and all(kind == "positive" and trainable > 0 for kind, trainable in kinds)
    # Without a tokenizer the episode is stored and projected as untrainable, not lost.
    _, bare = record_example_episode(store, seed=4, run_id=f"example-{uuid.uuid4().hex[:8]}")
    assert project_episode(store, bare).outcome == "written"
