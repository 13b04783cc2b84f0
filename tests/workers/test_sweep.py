"""The sweep closes episodes whose worker died and leaves live ones alone."""

from __future__ import annotations

import datetime as dt
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
    store.append(live, [episode_started()])
    # As of a moment just under an hour after the live episode's event, the stale one has
    # been silent for over an hour and the live one not quite.
    live_at = store.read_stream(live)[-1].recorded_at
    now = live_at + dt.timedelta(hours=1) - dt.timedelta(microseconds=1)
    assert abort_stale_episodes(store, timeout_s=3600, now=now) >= 1
    events = store.read_stream(stale)
    assert events[-1].type == "episode_finished"
    assert events[-1].event.status == "aborted"
    assert [e.type for e in store.read_stream(live)] == ["episode_started"]
    # A second round finds nothing more to do for it.
    store.append(live, [RewardAssigned(value=0.0)])
    before = len(store.read_stream(stale))
    abort_stale_episodes(store, timeout_s=3600, now=now)
    assert len(store.read_stream(stale)) == before


def test_bad_timeout(worker_store: EventStore) -> None:
    store = worker_store
    with pytest.raises(ValueError, match="timeout_s"):
        abort_stale_episodes(store, timeout_s=0)
