"""Replay through real Celery worker processes and a real Redis: projection, idempotence,
invalid episodes, the sweep, SIGKILL mid-replay, and rebuilding from the log alone."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from typing import Any

import numpy as np
import pytest

from store.eventlog import NO_STREAM, EventStore, run_stream_id
from store.events import Event, LLMCalled, RunConfig, RunCreated
from store.projections import Projections
from tests.replay.replay_episodes import SEARCH_TOOL, Script, tool_call
from tests.replay.replay_tokenizers import qwen3_tokenizer
from tests.workers.conftest import _env, wait_for
from workers.replay.jobs.project import project_episode


@pytest.fixture(scope="module")
def qwen3() -> Any:
    return qwen3_tokenizer()


def rollback_episode(tokenizer: Any, run_id: str, group_id: str) -> list[Event]:
    """A search call that fails with a rolled-back error, its fix, and an answer."""
    s = Script(tokenizer, tools=[SEARCH_TOOL], group_id=group_id)
    s.events[0] = s.events[0].model_copy(update={"run_id": run_id})
    user = {"role": "user", "content": "Who wrote Dune?"}
    bad = {"role": "assistant", "content": "",
           "tool_calls": [tool_call("search", {"q": "Dune author"})]}
    s.call([user], bad, call_id="call-bad")
    ck = s.checkpoint("turn_1")
    s.tool("search", "TypeError: unexpected argument 'q'", error_type="TypeError")
    s.failed(ck, "turn_1", retry_index=0, failed_call_id="call-bad",
             errors=["unexpected argument 'q'"], error_types=["TypeError"])
    good = {"role": "assistant", "content": "",
            "tool_calls": [tool_call("search", {"query": "Dune author"})]}
    feedback = {"role": "user", "content": "The tool call failed: unexpected argument 'q'."}
    s.call([user, bad, feedback], good, call_id="call-fix")
    s.rolled_back(ck, ["call-bad"])
    s.checkpoint("turn_1", retry_count=1)
    s.tool("search", "Frank Herbert")
    tool_msg = {"role": "tool", "content": "Frank Herbert"}
    s.call([user, good, tool_msg], {"role": "assistant", "content": "Frank Herbert."},
           call_id="call-answer")
    return s.finish(1.0)


def new_run(store: EventStore, **config: Any) -> str:
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    store.append(run_stream_id(run_id),
                 [RunCreated(run_id=run_id, config=RunConfig(tokenizer="qwen3", **config))],
                 NO_STREAM)
    return run_id


def counts(store: EventStore, episode_id: str) -> dict[str, Any]:
    with store.db.connection() as conn:
        ep = conn.execute("SELECT status, reward, llm_calls, tool_errors, attempts_failed,"
                          " rollbacks, survivors, negatives FROM episodes WHERE episode_id = %s",
                          (episode_id,)).fetchone()
        samples = conn.execute("SELECT kind, count(*), sum(num_trainable) FROM samples"
                               " WHERE episode_id = %s GROUP BY kind ORDER BY kind",
                               (episode_id,)).fetchall()
        failures = conn.execute("SELECT source, tool_name, error_type, position_key, recovered"
                                " FROM failures WHERE episode_id = %s ORDER BY stream_version",
                                (episode_id,)).fetchall()
    return {"episode": ep, "samples": samples, "failures": failures}


@pytest.mark.timeout(300)
def test_worker_projects_a_finished_episode_once(worker_store, start_worker, qwen3) -> None:
    worker = start_worker("--queues", "replay")
    worker.wait_ready()
    run_id = new_run(worker_store)
    episode = f"ep-{uuid.uuid4().hex[:8]}"
    events = rollback_episode(qwen3, run_id, "g1")
    worker_store.append(episode, events[:-2], NO_STREAM)
    worker_store.append(episode, events[-2:])  # episode_finished: the replay task is sent
    projections = Projections(worker_store)
    wait_for(lambda: projections.projected_version(episode), what="the projection")
    first = counts(worker_store, episode)
    assert first["episode"] == ("completed", 1.0, 3, 1, 1, 1, 2, 1)
    assert [k for k, _, _ in first["samples"]] == ["negative", "positive"]
    assert first["samples"][0][1] == 1 and first["samples"][1][1] == 2
    assert first["failures"] == [
        ("tool", "search", "TypeError", "turn_1", True),
        ("attempt", None, "TypeError", "turn_1", True),
    ]
    # A redelivered or repeated replay changes nothing.
    from workers.app import app

    app.send_task("trajstore.replay_episode", args=[episode], queue="replay")
    assert project_episode(worker_store, episode).outcome == "skipped"
    assert counts(worker_store, episode) == first


@pytest.mark.timeout(300)
def test_bad_episode_is_invalid_and_does_not_block_others(worker_store, start_worker,
                                                          qwen3) -> None:
    worker = start_worker("--queues", "replay")
    worker.wait_ready()
    run_id = new_run(worker_store)
    bad_events = rollback_episode(qwen3, run_id, "g1")
    call = next(e for e in bad_events if isinstance(e, LLMCalled))
    corrupted = call.model_copy(update={"prompt_ids": np.array([1, 2, 3] * 20, dtype=np.int32)})
    bad_events = [corrupted if e is call else e for e in bad_events]
    bad, good = f"ep-bad-{uuid.uuid4().hex[:6]}", f"ep-good-{uuid.uuid4().hex[:6]}"
    worker_store.append(bad, bad_events, NO_STREAM)
    worker_store.append(good, rollback_episode(qwen3, run_id, "g1"), NO_STREAM)
    projections = Projections(worker_store)
    wait_for(lambda: projections.projected_version(good) and projections.projected_version(bad),
             what="both projections")
    bad_row = counts(worker_store, bad)
    assert bad_row["episode"][0] == "invalid" and bad_row["samples"] == []
    with worker_store.db.connection() as conn:
        reason = conn.execute("SELECT invalid_reason FROM episodes WHERE episode_id = %s",
                              (bad,)).fetchone()[0]
    assert "prompt" in reason.lower()
    assert counts(worker_store, good)["episode"][0] == "completed"
    assert worker.proc.poll() is None, "the worker died on a bad episode"


@pytest.mark.timeout(300)
def test_sweep_projects_episodes_whose_message_was_lost(worker_store, start_worker,
                                                        qwen3) -> None:
    # No dispatch installed: as if Redis had been down when the episode finished.
    run_id = new_run(worker_store)
    episode = f"ep-{uuid.uuid4().hex[:8]}"
    worker_store.append(episode, rollback_episode(qwen3, run_id, "g1"), NO_STREAM)
    projections = Projections(worker_store)
    assert projections.finished_unprojected() == [episode]
    worker = start_worker("--queues", "replay", "--beat")
    worker.wait_ready()
    wait_for(lambda: projections.projected_version(episode), what="the sweep")
    assert counts(worker_store, episode)["episode"][0] == "completed"
    assert projections.finished_unprojected() == []


@pytest.mark.timeout(400)
def test_sigkill_mid_replay_then_redelivery_projects_exactly_once(
    worker_store, worker_settings, start_worker, qwen3
) -> None:
    slow = start_worker("--queues", "replay", TRAJSTORE_FAULT_REPLAY_DELAY_S="60")
    slow.wait_ready()
    run_id = new_run(worker_store)
    episode = f"ep-{uuid.uuid4().hex[:8]}"
    worker_store.append(episode, rollback_episode(qwen3, run_id, "g1"), NO_STREAM)

    def replay_in_flight() -> bool:
        # The projection's rows are written and its transaction is open, not committed.
        # This test's database is the worker's alone: a transaction open in it that is not
        # ours is the replay, sleeping before its commit.
        with worker_store.db.connection() as conn:
            return bool(conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction'"
                " AND datname = current_database() AND pid <> pg_backend_pid()"
                " AND query LIKE 'INSERT%%'").fetchone()[0])

    wait_for(replay_in_flight, what="the replay to be mid-transaction")
    slow.kill()
    killed = time.monotonic()
    projections = Projections(worker_store)
    assert projections.projected_version(episode) is None, "a killed replay left rows"
    # The broker gives an unacknowledged task back once it is older than the visibility
    # timeout, when a worker looks: at its start, then only every 100 s (kombu restores on
    # every tenth of its 10-second polls). Start the fresh worker once the task is due.
    time.sleep(max(0.0, worker_settings.visibility_timeout_s + 1 - (time.monotonic() - killed)))
    fresh = start_worker("--queues", "replay")
    fresh.wait_ready()
    wait_for(lambda: projections.projected_version(episode), timeout=180,
             what="the redelivered replay")
    got = counts(worker_store, episode)
    assert got["episode"][0] == "completed"
    assert got["samples"][0][:2] == ("negative", 1) and got["samples"][1][:2] == ("positive", 2)
    assert len(got["failures"]) == 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("jobs", [1, 2])
def test_rebuild_from_the_log_gives_the_same_rows_and_keeps_lease_state(
    worker_store, worker_settings, qwen3, jobs
) -> None:
    run_id = new_run(worker_store)
    episodes = [f"ep-{i}-{uuid.uuid4().hex[:6]}" for i in range(3)]
    for i, ep in enumerate(episodes):
        worker_store.append(ep, rollback_episode(qwen3, run_id, f"g{i % 2}"), NO_STREAM)
        project_episode(worker_store, ep)

    def snapshot() -> list[tuple]:
        with worker_store.db.connection() as conn:
            return conn.execute(
                "SELECT episode_id, kind, timeline_index, reward, token_ids, loss_mask,"
                " logprobs, status FROM samples ORDER BY episode_id, kind, timeline_index"
            ).fetchall()

    with worker_store.db.transaction() as conn:
        conn.execute("UPDATE samples SET status = 'consumed', consumed_version = 1"
                     " WHERE episode_id = %s", (episodes[0],))
    before = snapshot()
    done = subprocess.run([sys.executable, "-m", "trajstore", "replay", "--rebuild",
                           "--jobs", str(jobs)],
                          env=_env(worker_settings), capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr
    assert "projected 3 episodes" in done.stdout
    assert snapshot() == before
