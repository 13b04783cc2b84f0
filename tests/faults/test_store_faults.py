"""Faults of the servers under the store, counting events lost and duplicated (both must be
0) and samples projected twice (0).

- PostgreSQL restarts during ingest: appends fail with a retryable error, the client retries
  the same batch (same event ids), nothing is lost or doubled.
- Redis stops during ingest: appends keep working (events are in PostgreSQL), replay messages
  are lost, and the sweep projects every episode once Redis is back.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis as redis_client

from store import errors
from store.db import Database
from store.eventlog import EventStore
from store.events import RewardAssigned, ToolReturned
from store.projections import Projections
from store.settings import Settings
from tests.factories import episode_started
from tests.workers.conftest import wait_for
from workers.replay.jobs.sweep import sweep_unprojected


def _batches(n: int) -> list[tuple[str, list[Any]]]:
    out = []
    for i in range(n):
        stream = f"ep-{i}-{uuid.uuid4().hex[:6]}"
        out.append((stream, [
            episode_started(event_id=uuid.uuid4()),
            ToolReturned(event_id=uuid.uuid4(), name="calc", output=str(i)),
            RewardAssigned(event_id=uuid.uuid4(), value=float(i % 2)),
        ]))
    return out


@pytest.mark.timeout(300)
def test_postgres_restart_during_ingest_loses_and_doubles_nothing(own_postgres,
                                                                  tmp_path: Path) -> None:
    settings = Settings(database_url=own_postgres.url, data_dir=tmp_path)
    store = EventStore(Database(own_postgres.url, max_size=2), settings)
    batches = _batches(300)
    retries = Counter[str]()
    progress = {"done": 0}
    at_30 = threading.Event()
    done = threading.Event()

    def client() -> None:
        for i, (stream, events) in enumerate(batches):
            if i == 30:
                at_30.set()
            while True:
                try:
                    store.append(stream, events)
                    time.sleep(0.02)  # a steady client, so the restart lands mid-ingest
                    break
                except errors.TransientError as exc:
                    retries[str(exc).split(":")[0]] += 1
                    time.sleep(0.1)
            progress["done"] = i + 1
        done.set()

    thread = threading.Thread(target=client)
    thread.start()
    assert at_30.wait(timeout=120)
    with store.db.connection() as conn:
        started = conn.execute("SELECT pg_postmaster_start_time()").fetchone()[0]
    own_postgres.stop()
    stopped_at = progress["done"]
    time.sleep(1.5)
    own_postgres.start()
    thread.join(timeout=240)
    assert done.is_set(), "the client never finished"
    with store.db.connection() as conn:
        restarted = conn.execute("SELECT pg_postmaster_start_time()").fetchone()[0]
    assert restarted > started, "the server was not restarted"
    assert 0 < stopped_at < len(batches), "the restart did not land mid-ingest"

    with store.db.connection() as conn:
        rows = conn.execute("SELECT event_id, stream_id, stream_version FROM events").fetchall()
    stored = Counter(str(r[0]) for r in rows)
    sent = [str(e.event_id) for _, events in batches for e in events]
    lost = [eid for eid in sent if eid not in stored]
    doubled = [eid for eid, n in stored.items() if n > 1]
    assert (len(lost), len(doubled)) == (0, 0)
    for stream, _events in batches:
        assert [r.stream_version for r in store.read_stream(stream)] == [1, 2, 3]
    print(f"\nPostgreSQL restart after batch {stopped_at}: {len(sent)} events, "
          f"appends that failed and were retried {dict(retries)}, "
          f"lost {len(lost)}, duplicated {len(doubled)}")
    store.close()


@pytest.mark.timeout(400)
def test_redis_outage_during_ingest_then_the_sweep_catches_up(
    pg_server, own_redis, tmp_path: Path
) -> None:
    from store import migrate
    from tests.replay.replay_tokenizers import qwen3_tokenizer
    from tests.workers.test_replay_pipeline import new_run, rollback_episode
    from workers.app import app, configure

    url = pg_server.create_database()
    migrate.upgrade(url)
    settings = Settings(database_url=url, redis_url=own_redis.url, data_dir=tmp_path,
                        visibility_timeout_s=5)
    configure(app, settings)
    store = EventStore(Database(url, max_size=2), settings)
    qwen3 = qwen3_tokenizer()
    run_id = new_run(store)
    projections = Projections(store)
    per_episode_events = len(rollback_episode(qwen3, run_id, "g"))

    episodes: list[str] = []

    def ingest(n: int) -> None:
        for _ in range(n):
            ep = f"ep-{uuid.uuid4().hex[:8]}"
            store.append(ep, rollback_episode(qwen3, run_id, f"g{len(episodes) % 3}"))
            episodes.append(ep)

    from tests.workers.conftest import Worker

    worker = Worker(settings, ["--queues", "replay"], tmp_path / "worker.log")
    try:
        worker.wait_ready()
        ingest(3)
        wait_for(lambda: all(projections.projected_version(e) for e in episodes),
                 what="projection before the outage")
        # The outage comes between replays, as this test means it: its subject is the
        # messages sent while Redis is down. An outage under an unacknowledged replay is
        # tests/faults/test_worker_faults.py's.
        broker = redis_client.Redis(unix_socket_path=str(own_redis.socket))
        unacked = f"{settings.redis_key_prefix}unacked"
        wait_for(lambda: broker.hlen(unacked) == 0, what="the replays' acknowledgements")
        own_redis.stop()
        ingest(4)  # appends must keep working; the replay messages are lost
        during = episodes[-4:]
        assert all(store.stream_version(e) == per_episode_events for e in during)
        own_redis.start()
        ingest(2)
        # The worker reconnects and projects new episodes; the lost ones wait for the sweep.
        wait_for(lambda: all(projections.projected_version(e) for e in episodes[-2:]),
                 timeout=180, what="projection after the outage")
        swept = sweep_unprojected(store)
        assert swept <= 4
        assert all(projections.projected_version(e) for e in episodes)
    finally:
        worker.stop()
    with store.db.connection() as conn:
        per_episode = dict(conn.execute(
            "SELECT episode_id, count(*) FROM samples GROUP BY episode_id").fetchall())
        events = conn.execute("SELECT count(*), count(DISTINCT event_id) FROM events"
                              " WHERE stream_id = ANY(%s)", (episodes,)).fetchone()
    assert set(per_episode) == set(episodes)
    assert set(per_episode.values()) == {3}, "an episode was projected twice or partly"
    assert events == (per_episode_events * len(episodes),) * 2
    print(f"\nRedis outage: {len(episodes)} episodes, {events[0]} events, lost 0, "
          f"duplicated 0, projected by the sweep {swept}")
    store.close()
    pg_server.drop_database(url)
