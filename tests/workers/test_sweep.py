"""The sweep closes episodes whose worker died and leaves live ones alone."""

from __future__ import annotations

import time
import uuid

import pytest

from store.eventlog import EventStore
from store.events import RewardAssigned
from tests.factories import episode_started
from workers.replay.jobs.sweep import abort_stale_episodes


def test_stale_episode_is_aborted_live_one_is_not(worker_store: EventStore) -> None:
    store = worker_store  # a database of its own: no other test's open episodes
    stale, live = f"ep-{uuid.uuid4().hex}", f"ep-{uuid.uuid4().hex}"
    store.append(stale, [episode_started()])
    time.sleep(1.5)
    store.append(live, [episode_started()])
    assert abort_stale_episodes(store, timeout_s=1.0) >= 1
    events = store.read_stream(stale)
    assert events[-1].type == "episode_finished"
    assert events[-1].event.status == "aborted"
    assert [e.type for e in store.read_stream(live)] == ["episode_started"]
    # A second round finds nothing more to do for it.
    store.append(live, [RewardAssigned(value=0.0)])
    before = len(store.read_stream(stale))
    abort_stale_episodes(store, timeout_s=1.0)
    assert len(store.read_stream(stale)) == before


def test_bad_timeout(worker_store: EventStore) -> None:
    store = worker_store
    with pytest.raises(ValueError, match="timeout_s"):
        abort_stale_episodes(store, timeout_s=0)
