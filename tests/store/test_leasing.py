"""Leasing complete groups: completeness, the negative cap, exclusivity, ack/release/expiry,
staleness."""

from __future__ import annotations

import datetime as dt
import threading
import uuid

import numpy as np
import pytest

from store import errors
from store.eventlog import EventStore, run_stream_id
from store.events import PolicyUpdated
from store.leasing import LeaseExpired, Leasing
from store.projections import EpisodeProjection, EpisodeRow, Projections, RunRow, SampleRow
from tests.factories import database_now

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def _sample(run: str, group: str, episode: str, kind: str, index: int, *, version: int = 0,
            failed_at: dt.datetime | None = None) -> SampleRow:
    ids = np.arange(10, dtype=np.int32) + index
    mask = np.array([0] * 4 + [1] * 6, dtype=np.uint8)
    return SampleRow(run_id=run, group_id=group, episode_id=episode, agent="main", kind=kind,
                     timeline_index=index, reward=-1.0 if kind == "negative" else 1.0,
                     policy_version=version, prompt_length=4, token_ids=ids, loss_mask=mask,
                     logprobs=np.where(mask == 1, -0.5, 0.0).astype(np.float32),
                     failed_at=failed_at, failure_version=index if failed_at else None)


def add_group(store: EventStore, run: str, group: str, *, episodes: int, size: int = 2,
              negatives: int = 0, version: int = 0, max_negatives: int = 1,
              status: str = "completed") -> list[str]:
    """Project ``episodes`` episodes of ``group`` (each one positive sample, ``negatives``
    failures each)."""
    projections = Projections(store)
    ids = []
    for e in range(episodes):
        episode = f"{group}-ep{e}-{uuid.uuid4().hex[:6]}"
        samples = [_sample(run, group, episode, "positive", 0, version=version)]
        samples += [_sample(run, group, episode, "negative", 100 + k, version=version,
                            failed_at=T0 + dt.timedelta(minutes=10 * (episodes - e) + k))
                    for k in range(negatives)]
        projections.write(EpisodeProjection(
            run=RunRow(run_id=run, project="p", group_size=size,
                       max_negatives_per_group=max_negatives, save_negative_samples=True,
                       config={}, created_at=T0),
            episode=EpisodeRow(episode_id=episode, run_id=run, group_id=group,
                               status=status, projected_version=5, reward=1.0,
                               policy_version=version, finished_at=T0),
            samples=samples))
        ids.append(episode)
    return ids


def new_run() -> str:
    return f"run-{uuid.uuid4().hex[:8]}"


def test_only_complete_groups_with_capped_negatives(store: EventStore) -> None:
    run = new_run()
    leasing = Leasing(store)
    add_group(store, run, "partial", episodes=1, size=2)
    assert leasing.lease_batch(run, groups=4, lease_seconds=60) is None
    episodes = add_group(store, run, "full", episodes=2, size=2, negatives=2)
    lease = leasing.lease_batch(run, groups=4, lease_seconds=60, trainer="t1")
    assert lease is not None and lease.groups == ["full"]
    kinds = sorted(s.kind for s in lease.samples)
    assert kinds == ["negative", "positive", "positive"]
    (negative,) = [s for s in lease.samples if s.is_negative]
    # Earliest in its episode first, then by episode id: both first failures stand at the
    # same stream position, so the first episode's is kept, although the second episode's
    # happened earlier in time (wall-clock time depends on scheduling).
    assert negative.episode_id == episodes[0] and negative.reward == -1.0
    s = lease.samples[0]
    assert s.prompt_ids.tolist() == s.token_ids[:4].tolist()
    assert s.response_mask.tolist() == [1] * 6 and s.rollout_logprobs.tolist() == [-0.5] * 6
    assert leasing.stats(run) == {"ready": 1, "leased": 3, "consumed": 0, "stale": 0,
                                  "skipped": 3, "no_reward": 0}


def test_aborted_episodes_do_not_complete_a_group(store: EventStore) -> None:
    run = new_run()
    leasing = Leasing(store)
    add_group(store, run, "g", episodes=1, size=2)
    add_group(store, run, "g", episodes=1, size=2, status="aborted")
    assert leasing.lease_batch(run, groups=1, lease_seconds=60) is None
    add_group(store, run, "g", episodes=1, size=2)  # the replacement episode
    lease = leasing.lease_batch(run, groups=1, lease_seconds=60)
    assert lease is not None and lease.groups == ["g"]


def test_two_trainers_never_share_a_sample(store: EventStore) -> None:
    run = new_run()
    for g in range(12):
        add_group(store, run, f"g{g:02d}", episodes=2)
    leasing = Leasing(store)
    got: list[list[int]] = [[], [], [], []]
    barrier = threading.Barrier(4)

    def trainer(i: int) -> None:
        barrier.wait()
        while (lease := leasing.lease_batch(run, groups=2, lease_seconds=60)) is not None:
            got[i] += [s.sample_id for s in lease.samples]

    threads = [threading.Thread(target=trainer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [sid for ids in got for sid in ids]
    assert len(every) == len(set(every)) == 24
    assert leasing.stats(run)["leased"] == 24


def test_ack_release_and_expiry(store: EventStore) -> None:
    run = new_run()
    add_group(store, run, "a", episodes=2)
    add_group(store, run, "b", episodes=2)
    leasing = Leasing(store)
    first = leasing.lease_batch(run, groups=1, lease_seconds=60)
    assert first is not None
    assert leasing.ack(first.lease_id, policy_version=1) == 2
    assert leasing.ack(first.lease_id, policy_version=1) == 2  # idempotent
    with pytest.raises(LeaseExpired):
        leasing.release(first.lease_id)
    second = leasing.lease_batch(run, groups=1, lease_seconds=60)
    assert second is not None and second.groups == ["b"]
    assert leasing.release(second.lease_id) == 2
    third = leasing.lease_batch(run, groups=1, lease_seconds=60)
    assert third is not None and third.groups == ["b"]
    with pytest.raises(ValueError, match="timezone-aware"):
        leasing.expire(now=dt.datetime.now())
    leasing.expire()  # by the database's clock it has not expired yet
    assert leasing.stats(run)["leased"] == 2
    # expire() gives back every expired lease of the database, so leases other tests left
    # to expire may go back with this run's: count this run's samples, not the total.
    assert leasing.expire(now=database_now(store) + dt.timedelta(minutes=2)) >= 2
    assert {k: v for k, v in leasing.stats(run).items() if v} == {"consumed": 2, "ready": 2}
    with pytest.raises(LeaseExpired):
        leasing.ack(third.lease_id, policy_version=2)
    with pytest.raises(LeaseExpired):
        leasing.renew(third.lease_id, 60)
    fourth = leasing.lease_batch(run, groups=1, lease_seconds=60)
    assert fourth is not None and fourth.groups == ["b"]
    assert leasing.renew(fourth.lease_id, 120) > fourth.expires_at
    assert leasing.ack(fourth.lease_id, policy_version=2) == 2
    assert leasing.stats(run)["consumed"] == 4
    with pytest.raises(errors.NotFoundError):
        leasing.ack(uuid.uuid4(), policy_version=1)


def test_stale_groups_are_skipped_and_counted(store: EventStore) -> None:
    run = new_run()
    add_group(store, run, "old", episodes=2, version=0)
    add_group(store, run, "new", episodes=2, version=3)
    store.append(run_stream_id(run), [PolicyUpdated(version=3, step=3)])
    leasing = Leasing(store)
    assert leasing.current_policy_version(run) == 3
    lease = leasing.lease_batch(run, groups=4, lease_seconds=60, max_staleness=1)
    assert lease is not None and lease.groups == ["new"] and lease.skipped_stale == 2
    assert leasing.stats(run)["stale"] == 2


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"groups": 0, "lease_seconds": 60}, "groups"),
    ({"groups": 1, "lease_seconds": 0}, "lease_seconds"),
    ({"groups": 1, "lease_seconds": 60, "max_staleness": -1}, "max_staleness"),
])
def test_bad_arguments(store: EventStore, kwargs: dict, field: str) -> None:
    with pytest.raises(errors.ValidationError) as info:
        Leasing(store).lease_batch("r", **kwargs)
    assert info.value.field == field
