"""The rollout queue through real ``trajstore worker --queues rollout,replay`` processes and a
real Redis: a group is played, closed, replayed into samples; a second delivery does not
double it; a worker killed in the middle of a group leaves it to be completed, not doubled."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest

from store.eventlog import NO_STREAM, EventStore, run_stream_id
from store.events import RunConfig, RunCreated
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
from workers.rollout.group import episode_id_for, group_id_for


def new_run(store: EventStore, settings: Settings, group_size: int) -> str:
    model = tiny_model_path(settings.data_dir / "models")
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    store.append(run_stream_id(run_id), [RunCreated(run_id=run_id, config=RunConfig(
        group_size=group_size, tokenizer=str(model)))], NO_STREAM)
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


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_killed_worker_leaves_the_group_to_be_completed(
        worker_store: EventStore, worker_settings: Settings,  # noqa: F811
        start_worker: Callable[..., Any]) -> None:  # noqa: F811
    """SIGKILL while many episodes of the group are in flight at once: the redelivered
    group closes each of them as aborted and plays its slot again, so every slot ends with
    exactly one played episode and nothing finished before the kill is lost."""
    n = 16
    run_id = new_run(worker_store, worker_settings, group_size=n)
    first = start_worker("--queues", "rollout")
    first.wait_ready()
    send(run_id, "arith-0-2")
    wait_for(lambda: running(worker_store, run_id) >= 4, 240, "episodes in flight")
    first.kill()
    in_flight = running(worker_store, run_id)
    done_before = set(finished(worker_store, run_id))
    assert in_flight >= 4, "the kill came when fewer than 4 episodes were in flight"
    assert len(done_before) < n, "the group finished before the kill; make it longer"

    second = start_worker("--queues", "rollout")
    second.wait_ready()
    group_id = group_id_for(run_id, "arith-0-2", 0, 0)

    def complete() -> bool:
        done = finished(worker_store, run_id)
        return sum(1 for e in done.values() if e.status != "aborted") == n

    wait_for(complete, 400, "the redelivered group to complete")
    episodes = {e.episode_id: e for e in worker_store.list_episodes(run_id)}
    played = [e for e in episodes.values() if e.status != "aborted"]
    aborted = [e for e in episodes.values() if e.status == "aborted"]
    assert len(played) == n and len(aborted) == in_flight
    assert all(e.status != "running" for e in episodes.values())
    assert done_before <= set(episodes)
    slots = sorted(e.episode_id.split("-r")[0] for e in played)
    assert slots == sorted(episode_id_for(group_id, k) for k in range(n))
