"""No invented reward, and late rewards, on the real store, replay and leasing.

An episode without ``reward_assigned`` is not trainable: its samples wait as ``no_reward``,
the exclusions view says so, and leasing never takes them (nor makes their reward a number).
A reward that arrives after ``episode_finished`` is taken while none of the episode's samples
is consumed or leased; the episode is replayed with it and its samples become ready. The
latest reward wins; every reward stays in the log."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import numpy as np
import pytest

from store import errors
from store.eventlog import NO_STREAM, EventStore, run_stream_id
from store.events import EpisodeFinished, Event, RewardAssigned, RunConfig, RunCreated
from store.leasing import LeasedSample, LeaseExpired, Leasing
from store.training_steps import exclusion_counts, exclusions
from tests.replay.replay_episodes import Script
from tests.replay.replay_tokenizers import qwen3_tokenizer
from workers.engines.tokenizers import load_tokenizer
from workers.replay.jobs.project import project_episode


@pytest.fixture(scope="module")
def qwen3() -> Any:
    return qwen3_tokenizer()


def new_run(store: EventStore, *, group_size: int = 2) -> str:
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    config = RunConfig(tokenizer="qwen3", group_size=group_size)
    store.append(run_stream_id(run_id), [RunCreated(run_id=run_id, config=config)],
                 NO_STREAM)
    return run_id


def unrewarded(qwen3: Any, run_id: str, group: str, seed: int = 0) -> list[Event]:
    """Two turns of a chat, finished without a reward."""
    s = Script(qwen3, group_id=group, seed=seed)
    s.events[0] = s.events[0].model_copy(update={"run_id": run_id})
    question = {"role": "user", "content": f"Name prime number {seed}."}
    answer = {"role": "assistant", "content": "Seven."}
    s.call([question], answer)
    s.call([question, answer, {"role": "user", "content": "Another?"}],
           {"role": "assistant", "content": "Eleven."})
    return [*s.events, EpisodeFinished(status="completed")]


def record(store: EventStore, events: list[Event]) -> str:
    episode = f"ep-{uuid.uuid4().hex[:8]}"
    store.append(episode, events, NO_STREAM)
    return episode


def rewarded(store: EventStore, qwen3: Any, run_id: str, reward: float = 1.0) -> str:
    """An episode of ``unrewarded``'s turns with ``reward`` before its finish, projected."""
    events = unrewarded(qwen3, run_id, "g")
    episode = record(store, [*events[:-1], RewardAssigned(value=reward), events[-1]])
    assert project_episode(store, episode).outcome == "written"
    return episode


def samples(store: EventStore, episode: str) -> list[tuple[str, int, str, float | None]]:
    with store.db.connection() as conn:
        return conn.execute(
            "SELECT kind, timeline_index, status, reward FROM samples WHERE episode_id = %s"
            " ORDER BY kind, timeline_index", (episode,)).fetchall()


def rewards_in_log(store: EventStore, episode: str) -> list[float]:
    return [r.event.value for r in store.read_stream(episode)
            if isinstance(r.event, RewardAssigned)]


def test_an_unrewarded_episode_waits_until_its_late_reward_arrives(store: EventStore,
                                                                   qwen3: Any) -> None:
    run_id = new_run(store)
    leasing = Leasing(store)
    first, second = (record(store, unrewarded(qwen3, run_id, "g", seed=i)) for i in range(2))
    for episode in (first, second):
        assert project_episode(store, episode).outcome == "written"
        assert samples(store, episode) == [("positive", 1, "no_reward", None)]
    # Not trainable: excluded as no_reward, never leased, counted in the run's analytics.
    assert [x.category for x in exclusions(store.db, episode_id=first)] == ["no_reward"]
    assert exclusion_counts(store.db, run_id)["no_reward"] == 2
    assert leasing.stats(run_id)["no_reward"] == 2 and leasing.stats(run_id)["ready"] == 0
    assert leasing.lease_batch(run_id, groups=1, lease_seconds=60) is None

    # A late reward (the Python API is the store's append) is taken and replayed.
    result = store.append(first, [RewardAssigned(value=0.5, source="grader")])
    assert result.version == 5  # episode_started, two calls, episode_finished, the reward
    assert project_episode(store, first).outcome == "written"
    assert samples(store, first) == [("positive", 1, "ready", 0.5)]
    assert exclusions(store.db, episode_id=first) == []
    # The group is not complete while its other episode has no reward.
    assert leasing.lease_batch(run_id, groups=1, lease_seconds=60) is None
    store.append(second, [RewardAssigned(value=1.0)])
    assert project_episode(store, second).outcome == "written"
    lease = leasing.lease_batch(run_id, groups=1, lease_seconds=60)
    assert lease is not None and lease.groups == ["g"]
    assert sorted(s.reward for s in lease.samples) == [0.5, 1.0]
    assert all(isinstance(s, LeasedSample) and type(s.reward) is float for s in lease.samples)
    assert exclusion_counts(store.db, run_id)["no_reward"] == 0


def test_the_latest_reward_wins_and_every_reward_stays_in_the_log(store: EventStore,
                                                                   qwen3: Any) -> None:
    run_id = new_run(store, group_size=1)
    episode = rewarded(store, qwen3, run_id)
    assert samples(store, episode) == [("positive", 1, "ready", 1.0)]
    store.append(episode, [RewardAssigned(value=0.25, source="grader")])
    # Held back from the moment the reward is stored: no trainer leases the old reward.
    assert samples(store, episode) == [("positive", 1, "no_reward", 1.0)]
    assert Leasing(store).lease_batch(run_id, groups=1, lease_seconds=60) is None
    project_episode(store, episode)
    assert samples(store, episode) == [("positive", 1, "ready", 0.25)]
    store.append(episode, [RewardAssigned(value=0.75, source="grader")])
    project_episode(store, episode)
    assert samples(store, episode) == [("positive", 1, "ready", 0.75)]
    assert rewards_in_log(store, episode) == [1.0, 0.25, 0.75]
    with store.db.connection() as conn:
        assert conn.execute("SELECT reward FROM episodes WHERE episode_id = %s",
                            (episode,)).fetchone()[0] == 0.75


def test_a_reward_for_leased_or_consumed_samples_is_refused_naming_them(
        store: EventStore, qwen3: Any) -> None:
    run_id = new_run(store, group_size=1)
    leasing = Leasing(store)
    episode = rewarded(store, qwen3, run_id)
    lease = leasing.lease_batch(run_id, groups=1, lease_seconds=60)
    assert lease is not None
    (sample,) = lease.samples
    version = store.stream_version(episode)
    with pytest.raises(errors.SamplesTakenError) as info:
        store.append(episode, [RewardAssigned(value=0.0)])
    assert info.value.consumed is False
    assert info.value.samples == [{"sample_id": sample.sample_id, "kind": "positive",
                                   "timeline_index": 1, "status": "leased"}]
    assert str(sample.sample_id) in str(info.value)
    assert store.stream_version(episode) == version  # nothing stored
    assert samples(store, episode) == [("positive", 1, "leased", 1.0)]

    leasing.ack(lease.lease_id, policy_version=1)
    with pytest.raises(errors.SamplesTakenError, match="trained with the reward") as info:
        store.append(episode, [RewardAssigned(value=0.0)])
    assert info.value.consumed is True and info.value.samples[0]["status"] == "consumed"
    assert store.stream_version(episode) == version
    assert rewards_in_log(store, episode) == [1.0]
    assert samples(store, episode) == [("positive", 1, "consumed", 1.0)]


def test_a_lease_past_its_expiry_does_not_hold_a_reward_back(store: EventStore,
                                                              qwen3: Any) -> None:
    run_id = new_run(store, group_size=1)
    leasing = Leasing(store)
    episode = rewarded(store, qwen3, run_id)
    lease = leasing.lease_batch(run_id, groups=1, lease_seconds=60)
    assert lease is not None
    with store.db.connection() as conn:  # the trainer died: its lease ran out
        conn.execute("UPDATE leases SET expires_at = now() - interval '1 second'"
                     " WHERE lease_id = %s", (lease.lease_id,))
    store.append(episode, [RewardAssigned(value=0.0)])
    with pytest.raises(LeaseExpired):  # the late trainer cannot count it as trained
        leasing.ack(lease.lease_id, policy_version=1)
    project_episode(store, episode)
    assert samples(store, episode) == [("positive", 1, "ready", 0.0)]


def test_a_reward_racing_with_a_projection_holds_the_samples_back(store: EventStore,
                                                                   qwen3: Any) -> None:
    """A projection that read the episode before a late reward never leaves its samples
    ready with the old reward: either the reward's append finds them (projection committed
    first) or the projection sees the newer version (reward committed first)."""
    run_id = new_run(store, group_size=1)
    events = unrewarded(qwen3, run_id, "g")
    late, early = (record(store, [*events[:-1], RewardAssigned(value=1.0), events[-1]])
                   for _ in range(2))

    # The reward commits after the projection read the events, before it writes.
    def reward_then_load(name: str | None) -> Any:
        store.append(late, [RewardAssigned(value=0.5)])
        return load_tokenizer(name)

    assert project_episode(store, late, tokenizer_loader=reward_then_load).outcome == "written"
    assert samples(store, late) == [("positive", 1, "no_reward", 1.0)]
    project_episode(store, late)
    assert samples(store, late) == [("positive", 1, "ready", 0.5)]

    # The reward's append starts while the projection's transaction is open: it waits for
    # it, then holds back the samples the projection wrote.
    appender = threading.Thread(
        target=lambda: store.append(early, [RewardAssigned(value=0.5)]))
    assert project_episode(store, early, before_commit=appender.start).outcome == "written"
    appender.join(timeout=60)
    assert not appender.is_alive()
    assert samples(store, early) == [("positive", 1, "no_reward", 1.0)]
    assert Leasing(store).lease_batch(run_id, groups=1, lease_seconds=60) is not None
    lease_groups = Leasing(store).stats(run_id)
    assert lease_groups["leased"] == 1 and lease_groups["no_reward"] == 1


@pytest.mark.parametrize("value", [True, False, "1.0", float("nan"), float("inf"), None])
def test_a_reward_that_is_no_finite_number_is_refused(store: EventStore, qwen3: Any,
                                                      value: Any) -> None:
    run_id = new_run(store, group_size=1)
    episode = record(store, unrewarded(qwen3, run_id, "g"))
    with pytest.raises(errors.ValidationError) as info:
        store.append(episode, [{"type": "reward_assigned", "value": value}])  # type: ignore[list-item]
    assert info.value.field == "value" and info.value.event_index == 0
    assert rewards_in_log(store, episode) == [] and store.stream_version(episode) == 4


def test_a_reward_for_an_unknown_episode_is_not_found(store: EventStore) -> None:
    missing = f"ep-{uuid.uuid4().hex[:8]}"
    with pytest.raises(errors.NotFoundError, match="no episode"):
        store.append(missing, [RewardAssigned(value=1.0)])
    assert store.stream_version(missing) == 0


def test_leasing_hands_out_numbers_only(store: EventStore, qwen3: Any) -> None:
    """Every sample of a lease has a float reward (LeasedSample's contract): a group whose
    rewarded episodes complete it is leased without the unrewarded episode's samples."""
    run_id = new_run(store, group_size=1)
    scored = rewarded(store, qwen3, run_id)
    waiting = record(store, unrewarded(qwen3, run_id, "g", seed=1))
    project_episode(store, waiting)
    lease = Leasing(store).lease_batch(run_id, groups=1, lease_seconds=60)
    assert lease is not None
    assert [s.episode_id for s in lease.samples] == [scored]
    assert all(np.isfinite(s.reward) for s in lease.samples)
    assert samples(store, waiting) == [("positive", 1, "no_reward", None)]
