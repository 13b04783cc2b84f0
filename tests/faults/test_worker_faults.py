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
from tests.rollout.test_group_worker import finished, new_run, send
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
