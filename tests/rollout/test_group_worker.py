"""The rollout queue through real ``trajstore worker --queues rollout,replay`` processes and a
real Redis: a group is played, closed, replayed into samples; a second delivery does not
double it; a worker killed in the middle of a group leaves it to be completed, not doubled."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from store.eventlog import NO_STREAM, EventStore, run_stream_id
from store.events import LLMCalled, RolloutConfig, RunConfig, RunCreated
from store.settings import Settings
from tests.workers.conftest import (  # noqa: F401  (fixtures)
    broker_url,
    start_worker,
    wait_for,
    worker_db,
    worker_settings,
    worker_store,
)
from workers.engines.tinymodel import tiny_model_path
from workers.rollout.episode_writer import deterministic_event_id
from workers.rollout.group import episode_id_for, group_id_for


def new_run(store: EventStore, settings: Settings, group_size: int,
            seed: int | None = None) -> str:
    model = tiny_model_path(settings.data_dir / "models")
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    store.append(run_stream_id(run_id), [RunCreated(run_id=run_id, config=RunConfig(
        group_size=group_size, tokenizer=str(model), rollout=RolloutConfig(seed=seed)))],
        NO_STREAM)
    return run_id


def send(run_id: str, task_id: str) -> None:
    """Queue a group: its size is the run's group_size, not an argument of the task."""
    from workers.app import ensure_configured

    ensure_configured().send_task("trajstore.rollout_group", args=[run_id, task_id],
                                  queue="rollout")


def finished(store: EventStore, run_id: str) -> dict[str, Any]:
    return {e.episode_id: e for e in store.list_episodes(run_id) if e.status != "running"}


def projected(store: EventStore, run_id: str) -> int:
    with store.db.connection() as conn:
        return int(conn.execute("SELECT count(*) FROM episodes WHERE run_id = %s",
                                (run_id,)).fetchone()[0])


@pytest.mark.timeout(400)
def test_worker_plays_a_group_once_and_replays_it(
        worker_store: EventStore, worker_settings: Settings,  # noqa: F811
        start_worker: Callable[..., Any]) -> None:  # noqa: F811
    run_id = new_run(worker_store, worker_settings, group_size=2)
    worker = start_worker("--queues", "rollout,replay")
    worker.wait_ready()
    send(run_id, "arith-0-1")
    wait_for(lambda: len(finished(worker_store, run_id)) == 2, 240, "the group's 2 episodes")
    group_id = group_id_for(run_id, "arith-0-1", 0, 0)
    episodes = finished(worker_store, run_id)
    assert sorted(episodes) == [episode_id_for(group_id, 0), episode_id_for(group_id, 1)]
    for episode_id in episodes:
        types = [e.type for e in worker_store.get_episode(episode_id)]
        assert types[0] == "episode_started"
        assert types[-2:] == ["reward_assigned", "episode_finished"]
        assert "llm_called" in types
    wait_for(lambda: projected(worker_store, run_id) == 2, 120, "replay of both episodes")

    # The same task delivered again, then another one as a barrier (one task at a time).
    send(run_id, "arith-0-1")
    send(run_id, "fc-0-0")
    wait_for(lambda: len(finished(worker_store, run_id)) == 4, 240, "the barrier group")
    assert len(worker_store.list_episodes(run_id)) == 4
    assert "ready." in worker.log_path.read_text()


def running(store: EventStore, run_id: str) -> int:
    return sum(1 for e in store.list_episodes(run_id) if e.status == "running")


def samples_of(store: EventStore, group_id: str, n: int
               ) -> list[tuple[list[list[int]], list[list[float]], Any]]:
    """Per slot: each LLM call's response ids and log-probs, and the reward."""
    out = []
    for k in range(n):
        events = [r.event for r in store.read_stream(episode_id_for(group_id, k))]
        calls = [e for e in events if isinstance(e, LLMCalled)]
        reward = next(e.value for e in events if e.type == "reward_assigned")
        out.append(([c.response_ids.tolist() for c in calls],
                    [c.logprobs.tolist() for c in calls], reward))
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_killed_worker_leaves_the_group_to_be_completed(
        worker_store: EventStore, worker_settings: Settings,  # noqa: F811
        start_worker: Callable[..., Any]) -> None:  # noqa: F811
    """SIGKILL while many episodes of the group are in flight at once: the redelivered
    group resumes each of them where its log ends (the same episode, its stored events
    kept, nothing appended twice), so every slot ends with exactly one episode, nothing
    finished before the kill is lost, and the group samples what an uninterrupted group
    with the same seed samples."""
    import time

    from workers.rollout import group as group_module

    n = 16
    run_id = new_run(worker_store, worker_settings, group_size=n, seed=5)
    first = start_worker("--queues", "rollout")
    first.wait_ready()
    send(run_id, "arith-0-2")
    wait_for(lambda: running(worker_store, run_id) >= 4, 240, "episodes in flight")
    first.kill()
    killed_at = time.monotonic()
    in_flight = {e.episode_id for e in worker_store.list_episodes(run_id)
                 if e.status == "running"}
    stored = {eid: [r.event.event_id for r in worker_store.read_stream(eid)]
              for eid in in_flight}
    done_before = set(finished(worker_store, run_id))
    assert len(in_flight) >= 4, "the kill came when fewer than 4 episodes were in flight"
    assert len(done_before) < n, "the group finished before the kill; make it longer"

    # The broker hands the unacknowledged task out again once its visibility timeout (5 s
    # here) has passed, looking at worker start.
    time.sleep(max(0.0, killed_at + worker_settings.visibility_timeout_s + 1
                   - time.monotonic()))
    second = start_worker("--queues", "rollout")
    second.wait_ready()
    group_id = group_id_for(run_id, "arith-0-2", 0, 0)
    slots = sorted(episode_id_for(group_id, k) for k in range(n))

    wait_for(lambda: len(finished(worker_store, run_id)) == n, 400,
             "the redelivered group to complete")
    episodes = {e.episode_id: e for e in worker_store.list_episodes(run_id)}
    assert sorted(episodes) == slots  # no replacement attempts
    assert all(e.status not in ("running", "aborted", "error") for e in episodes.values())
    assert done_before <= set(episodes)
    namespace = uuid.uuid5(group_module._NAMESPACE, group_id)
    for eid in in_flight:
        ids = [r.event.event_id for r in worker_store.read_stream(eid)]
        assert ids[:len(stored[eid])] == stored[eid], f"{eid}: stored events changed"
        assert ids == [deterministic_event_id(namespace, eid, v)
                       for v in range(1, len(ids) + 1)], f"{eid}: a duplicate or a gap"
        assert len(ids) > len(stored[eid])

    # The same group of a run with the same seed, played without a kill.
    reference = new_run(worker_store, worker_settings, group_size=n, seed=5)
    send(reference, "arith-0-2")
    wait_for(lambda: len(finished(worker_store, reference)) == n, 400, "the reference group")
    got = samples_of(worker_store, group_id, n)
    want = samples_of(worker_store, group_id_for(reference, "arith-0-2", 0, 0), n)
    for (ids, logprobs, reward), (ref_ids, ref_logprobs, ref_reward) in zip(got, want,
                                                                            strict=True):
        assert ids == ref_ids and reward == ref_reward
        for mine, theirs in zip(logprobs, ref_logprobs, strict=True):
            np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-4)
