"""Heartbeats and group leases in a real Redis: a lease whose worker stopped beating is
queued again exactly once however many watchers see it; a live worker's lease and a
released one are not; bad leases and tasks are refused with a clear error."""

from __future__ import annotations

import json
from typing import Any

import pytest

from store.settings import Settings
from tests.workers.conftest import broker_url  # noqa: F401  (fixture)
from workers.rollout.liveness import Liveness, _redis_client


@pytest.fixture
def settings(broker_url: str, tmp_path: Any) -> Settings:  # noqa: F811
    return Settings(redis_url=broker_url, data_dir=tmp_path, rollout_heartbeat_s=0.1,
                    rollout_dead_after_s=0.5)


def test_a_dead_workers_lease_is_requeued_once(settings: Settings) -> None:
    sent: list[tuple[str, list[Any], dict[str, Any]]] = []
    client = _redis_client(settings)

    def send(task: str, args: list[Any], kwargs: dict[str, Any]) -> None:
        sent.append((task, args, kwargs))

    dead = Liveness(settings, client=client, send=send, worker_id="dead")
    live = Liveness(settings, client=client, send=send, worker_id="live")
    watchers = [Liveness(settings, client=client, send=send, worker_id=f"w{i}")
                for i in range(3)]
    lease = dead.take("trajstore.rollout_group", ["run-1", "arith-0-1"],
                      {"group_index": 2, "policy_version": 3})
    live.take("trajstore.rollout_group", ["run-1", "arith-0-2"], {"group_index": 0})
    released = live.take("trajstore.rollout_group", ["run-1", "arith-0-3"], {})
    live.release(released)
    assert [w.sweep() for w in watchers] == [[], [], []]  # both still beat
    client.delete("trajstore:rollout:alive:dead")  # its heartbeat expired
    live.beat()
    assert [w.sweep() for w in watchers] == [[lease], [], []]
    assert sent == [("trajstore.rollout_group", ["run-1", "arith-0-1"],
                     {"group_index": 2, "policy_version": 3})]
    # The lease is gone; a watcher that read it before it went finds the claim taken.
    client.hset("trajstore:rollout:leases", lease, json.dumps(
        {"worker": "dead", "task": "trajstore.rollout_group", "args": [], "kwargs": {}}))
    assert watchers[2].sweep() == [] and len(sent) == 1


def test_bad_leases_and_tasks_are_refused(settings: Settings) -> None:
    client = _redis_client(settings)
    watcher = Liveness(settings, client=client, send=lambda *a: None, worker_id="w")
    with pytest.raises(ValueError, match="'trajstore.train_step' is not a task a lease can"):
        watcher.take("trajstore.train_step", [], {})
    client.hset("trajstore:rollout:leases", "junk", "{not json")
    assert watcher.sweep() == []
    assert not client.hexists("trajstore:rollout:leases", "junk")
    with pytest.raises(ValueError, match="rollout_dead_after_s"):
        Settings(rollout_heartbeat_s=2, rollout_dead_after_s=1)


def test_a_stopped_worker_beats_no_more(settings: Settings) -> None:
    client = _redis_client(settings)
    worker = Liveness(settings, client=client, worker_id="me")
    worker.start()
    assert client.exists("trajstore:rollout:alive:me")
    worker.stop()
    assert not client.exists("trajstore:rollout:alive:me")
