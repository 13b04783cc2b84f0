"""A rollout worker SIGKILLed mid-episode: the half-written episode is closed ``aborted`` by
the sweep once it has been silent for the timeout, nothing it appended is lost or doubled,
and the aborted episode gives no sample (so nothing is trained from it, let alone twice).
A replay worker whose Redis is killed and started again while a replay is unacknowledged
keeps running and reconnects."""

from __future__ import annotations

import datetime as dt
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis as redis_client

from store.db import Database
from store.eventlog import NO_STREAM, EventStore
from store.projections import Projections
from store.settings import Settings
from tests.factories import database_now
from tests.rollout.test_group_worker import finished, new_run, send
from tests.workers.conftest import (  # noqa: F401  (fixtures)
    Worker,
    broker_url,
    start_worker,
    wait_for,
    worker_db,
    worker_settings,
    worker_store,
)
from workers.replay.jobs.sweep import abort_stale_episodes, sweep_unprojected


def _open_episodes(store: EventStore, run_id: str) -> list[str]:
    return [e.episode_id for e in store.list_episodes(run_id) if e.status == "running"]


@pytest.mark.timeout(600)
def test_killed_rollout_worker_leaves_an_episode_the_sweep_aborts(
        worker_store: EventStore, worker_settings: Settings,  # noqa: F811
        start_worker: Callable[..., Any]) -> None:  # noqa: F811
    run_id = new_run(worker_store, worker_settings, group_size=8)
    worker = start_worker("--queues", "rollout")
    worker.wait_ready()
    send(run_id, "arith-0-2")
    # Kill it while an episode is open (started, not finished).
    wait_for(lambda: _open_episodes(worker_store, run_id), 300, "an episode in progress")
    worker.kill()
    open_now = _open_episodes(worker_store, run_id)
    assert open_now, "the episode finished before the kill"
    with worker_store.db.connection() as conn:
        before = conn.execute("SELECT event_id FROM events WHERE run_id = %s",
                              (run_id,)).fetchall()
    later = database_now(worker_store) + dt.timedelta(seconds=3)
    assert abort_stale_episodes(worker_store, timeout_s=2.0, now=later) >= len(open_now)
    sweep_unprojected(worker_store)
    for episode_id in open_now:
        last = worker_store.read_stream(episode_id)[-1].event
        assert last.type == "episode_finished" and last.status == "aborted"
    with worker_store.db.connection() as conn:
        after = conn.execute("SELECT event_id FROM events WHERE run_id = %s",
                             (run_id,)).fetchall()
        samples = conn.execute("SELECT count(*) FROM samples WHERE episode_id = ANY(%s)"
                               " AND kind = 'positive'", (open_now,)).fetchone()[0]
    counts = Counter(str(r[0]) for r in after)
    assert {str(r[0]) for r in before} <= set(counts), "events were lost"
    assert max(counts.values()) == 1, "events were doubled"
    assert samples == 0, "an aborted episode produced samples"
    print(f"\nrollout worker killed: {len(open_now)} open episode(s) aborted by the sweep, "
          f"{len(counts)} events, lost 0, duplicated 0")


@pytest.mark.timeout(600)
def test_a_killed_rollout_workers_group_is_resumed_long_before_the_visibility_timeout(
        worker_store: EventStore, worker_settings: Settings,  # noqa: F811
        start_worker: Callable[..., Any]) -> None:  # noqa: F811
    """A rollout worker SIGKILLed mid-group, the broker's visibility timeout an hour: the
    broker alone would deliver the group again only after that hour (the test's own timeout
    is ten minutes), so only the heartbeat's requeue explains that another worker started
    after the kill resumes the open episodes, appending after their stored events, and
    completes the group without a lost or doubled event and with no episode aborted."""
    settings = worker_settings.model_copy(update={"visibility_timeout_s": 3600})
    env = {"TRAJSTORE_VISIBILITY_TIMEOUT_S": "3600", "TRAJSTORE_ROLLOUT_DEAD_AFTER_S": "3",
           "TRAJSTORE_ROLLOUT_HEARTBEAT_S": "0.5"}
    from workers.app import app, configure

    configure(app, settings)
    run_id = new_run(worker_store, settings, group_size=8)
    first = start_worker("--queues", "rollout", **env)
    first.wait_ready()
    send(run_id, "arith-0-3")
    wait_for(lambda: _open_episodes(worker_store, run_id), 300, "an episode in progress")
    first.kill()
    open_now = _open_episodes(worker_store, run_id)
    assert open_now, "the episode finished before the kill"
    stored = {e: [r.event.event_id for r in worker_store.read_stream(e)] for e in open_now}

    second = start_worker("--queues", "rollout", **env)
    second.wait_ready()
    wait_for(lambda: len(finished(worker_store, run_id)) == 8, 300, "the group, resumed")
    episodes = finished(worker_store, run_id)
    assert "aborted" not in {e.status for e in episodes.values()}
    for episode_id, before in stored.items():
        after = [r.event.event_id for r in worker_store.read_stream(episode_id)]
        assert after[:len(before)] == before, "a stored event was replaced"
        assert len(after) > len(before) and after[-1] != before[-1], "not resumed"
    with worker_store.db.connection() as conn:
        rows = conn.execute("SELECT event_id FROM events WHERE run_id = %s",
                            (run_id,)).fetchall()
    assert max(Counter(str(r[0]) for r in rows).values()) == 1, "events were doubled"
    assert "queued again" in second.log_path.read_text()


@pytest.mark.timeout(300)
def test_a_replay_worker_survives_a_redis_outage_under_an_unacknowledged_replay(
        own_redis: Any, worker_db: str, tmp_path: Path) -> None:  # noqa: F811
    """Redis is killed while a replay (acks_late) is running, then started again on the same
    socket. With kombu 5.7.0's own transport the worker stops here ("Unrecoverable error",
    an AttributeError on the released connection: ``workers.redis_transport``); it must stay
    up, finish the replay, reconnect, and replay an episode that finishes after the outage."""
    from tests.replay.replay_tokenizers import qwen3_tokenizer
    from tests.workers.test_replay_pipeline import new_run as new_replay_run
    from tests.workers.test_replay_pipeline import rollback_episode
    from workers.app import app, configure

    settings = Settings(database_url=worker_db, redis_url=own_redis.url, data_dir=tmp_path,
                        visibility_timeout_s=5)
    configure(app, settings)
    store = EventStore(Database(worker_db, max_size=2), settings)
    projections = Projections(store)
    qwen3 = qwen3_tokenizer()
    run_id = new_replay_run(store)
    broker = redis_client.Redis(unix_socket_path=str(own_redis.socket))
    worker = Worker(settings, ["--queues", "replay"], tmp_path / "worker.log",
                    TRAJSTORE_FAULT_REPLAY_DELAY_S="2")

    def log() -> str:
        return worker.log_path.read_text(errors="replace")

    def alive_and(predicate: Callable[[], object]) -> Callable[[], object]:
        def check() -> object:
            assert worker.proc.poll() is None, f"the worker stopped:\n{log()[-3000:]}"
            return predicate()
        return check

    def replayed(episode: str) -> Callable[[], object]:
        return alive_and(lambda: projections.projected_version(episode))

    try:
        worker.wait_ready()
        during = f"ep-{uuid.uuid4().hex[:8]}"
        store.append(during, rollback_episode(qwen3, run_id, "g1"), NO_STREAM)
        # Running and unacknowledged: held 2 s before its commit, its message in the
        # broker's unacknowledged hash.
        wait_for(alive_and(lambda: broker.hlen(f"{settings.redis_key_prefix}unacked")),
                 30, "the replay to be delivered")
        own_redis.stop()
        wait_for(alive_and(lambda: "Connection to broker lost" in log()), 30,
                 "the worker to see the broker go")
        own_redis.start()
        wait_for(replayed(during), 60, "the replay running during the outage")
        after = f"ep-{uuid.uuid4().hex[:8]}"
        store.append(after, rollback_episode(qwen3, run_id, "g1"), NO_STREAM)
        wait_for(replayed(after), 60, "a replay sent after the outage")
        assert worker.proc.poll() is None
        assert "Unrecoverable error" not in log()
        with store.db.connection() as conn:
            samples = dict(conn.execute(
                "SELECT episode_id, count(*) FROM samples WHERE episode_id = ANY(%s)"
                " GROUP BY episode_id", ([during, after],)).fetchall())
        assert samples == {during: 3, after: 3}, "an episode was projected twice or partly"
    finally:
        worker.stop()
        store.close()
