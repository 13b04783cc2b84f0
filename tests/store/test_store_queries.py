"""The read queries behind the store (lookups of runs and episodes, sweep, demo table,
readiness): what they return, for a replayed episode too, and what they do with bad input."""

from __future__ import annotations

import time
import uuid

import pytest

from store import errors, queries
from store.eventlog import NO_STREAM, EventStore, run_stream_id
from store.events import RunCreated
from tests.factories import closing, episode_started
from tests.replay.replay_tokenizers import qwen3_tokenizer
from tests.workers.test_replay_pipeline import new_run, rollback_episode
from workers.replay.jobs.project import project_episode


def test_run_and_episode_lookups(store: EventStore) -> None:
    run = f"run-{uuid.uuid4().hex[:8]}"
    store.append(run_stream_id(run), [RunCreated(run_id=run)], NO_STREAM)
    assert queries.get_run(store, run).run_id == run
    assert run in [r.run_id for r in queries.created_runs(store)]
    ep, other, running = (f"ep-{uuid.uuid4().hex}" for _ in range(3))
    store.append(ep, [episode_started(run_id=run, group_id="g1"), *closing(0.5)])
    store.append(other, [episode_started(run_id=run, group_id="g2"), *closing(0.0)])
    store.append(running, [episode_started(run_id=run, group_id="g1")])
    summaries = queries.episode_summaries(store, run)
    assert [(e.episode_id, e.group_id, e.status, e.reward, e.events) for e in summaries] == [
        (ep, "g1", "completed", 0.5, 4), (other, "g2", "completed", 0.0, 4),
        (running, "g1", "running", None, 1)]
    assert [e.episode_id for e in queries.episode_summaries(store, run, group_id="g1")] == [
        ep, running]
    assert queries.episode_summaries(store, "no-such-run") == []
    assert queries.get_episode(store, ep)[0].type == "episode_started"
    counts = queries.counts_by_type(store)
    assert counts["episode_started"] >= 3 and counts["run_created"] >= 1
    with pytest.raises(errors.NotFoundError, match="no-such-run"):
        queries.get_run(store, "no-such-run")
    with pytest.raises(errors.NotFoundError, match="no-such-episode"):
        queries.get_episode(store, "no-such-episode")
    with pytest.raises(errors.NotFoundError):  # a run's stream is no episode
        queries.get_episode(store, run_stream_id(run))
    # The store's own methods for these are the same lookups.
    assert store.get_run(run) == queries.get_run(store, run)
    assert store.list_episodes(run, group_id="g2") == summaries[1:2]
    assert store.get_episode(ep) == queries.get_episode(store, ep)
    assert store.counts_by_type() == queries.counts_by_type(store)
    assert [r.run_id for r in store.list_runs()] == [
        r.run_id for r in queries.created_runs(store)]


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
