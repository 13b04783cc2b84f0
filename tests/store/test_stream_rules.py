"""Where events may go: nothing after an episode's finish but a late reward, episode_started
only first, runs' streams apart from episodes'. Each rule is checked inside the append's lock."""

from __future__ import annotations

import uuid

import pytest

from store import errors
from store.eventlog import NO_STREAM, EventStore, run_stream_id
from store.events import EpisodeFinished, RewardAssigned, RunCreated, ToolReturned
from tests.factories import episode_started


def test_nothing_but_a_late_reward_is_appended_after_episode_finished(store: EventStore
                                                                      ) -> None:
    stream = f"ep-{uuid.uuid4().hex}"
    store.append(stream, [episode_started(), EpisodeFinished(status="completed")])
    for batch in ([EpisodeFinished(status="error")],
                  [RewardAssigned(value=1.0), EpisodeFinished(status="error")],
                  [RewardAssigned(value=1.0), ToolReturned(name="calc")]):
        with pytest.raises(errors.ClosedError, match="is finished"):
            store.append(stream, batch)
    assert store.stream_version(stream) == 2
    # A late reward is the one event a finished episode takes (tests/store/test_late_rewards).
    assert store.append(stream, [RewardAssigned(value=1.0)]).version == 3
    # A retry of the finishing batch itself is still an idempotent answer.
    events = [e.model_copy(update={"event_id": uuid.uuid4()})
              for e in (episode_started(), EpisodeFinished(status="completed"))]
    other = f"ep-{uuid.uuid4().hex}"
    first = store.append(other, events)
    assert store.append(other, events).duplicate and first.version == 2
    # Nothing may follow a finish inside one batch either.
    third = f"ep-{uuid.uuid4().hex}"
    with pytest.raises(errors.ValidationError, match="must be the last") as info:
        store.append(third, [episode_started(), EpisodeFinished(status="completed"),
                             RewardAssigned(value=1.0)])
    assert info.value.event_index == 2 and store.stream_version(third) == 0


def test_episode_started_only_opens_an_episode(store: EventStore) -> None:
    stream = f"ep-{uuid.uuid4().hex}"
    store.append(stream, [episode_started(run_id="run-a")])
    with pytest.raises(errors.ValidationError, match="first event") as info:
        store.append(stream, [episode_started(run_id="someone-elses-run")])
    assert info.value.field == "type"
    fresh = f"ep-{uuid.uuid4().hex}"
    with pytest.raises(errors.ValidationError, match="first event"):
        store.append(fresh, [RewardAssigned(value=0.0), episode_started(run_id="x")])
    assert store.stream_version(stream) == 1 and store.stream_version(fresh) == 0


def test_runs_and_episodes_never_share_a_stream(store: EventStore) -> None:
    name = f"r{uuid.uuid4().hex[:8]}"
    # An episode cannot take the stream a run of that name would need.
    with pytest.raises(errors.ValidationError, match="streams named 'run-"):
        store.append(run_stream_id(name), [episode_started()], NO_STREAM)
    with pytest.raises(errors.ValidationError, match="streams named 'run-"):
        store.append(f"ep-{uuid.uuid4().hex}", [RunCreated(run_id=name)], NO_STREAM)
    with pytest.raises(errors.ValidationError, match="own stream"):
        store.append(run_stream_id("other"), [RunCreated(run_id=name)], NO_STREAM)
    store.append(run_stream_id(name), [RunCreated(run_id=name)], NO_STREAM)
    assert store.get_run(name).run_id == name
