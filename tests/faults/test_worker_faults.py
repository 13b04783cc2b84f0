"""A rollout worker SIGKILLed mid-episode: the half-written episode is closed ``aborted`` by
the sweep once it has been silent for the timeout, nothing it appended is lost or doubled,
and the aborted episode gives no sample (so nothing is trained from it, let alone twice)."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from store.eventlog import EventStore
from store.settings import Settings
from tests.factories import database_now
from tests.rollout.test_group_worker import new_run, send
from tests.workers.conftest import (  # noqa: F401  (fixtures)
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
