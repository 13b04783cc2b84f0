"""The group log contract (``workers.rollout.group_log.GroupLog``), written once and run
against both logs: :class:`StoreGroupLog` on the database and :class:`ApiGroupLog` through the
real API app (served by uvicorn over the same store).

What a rollout worker relies on, whichever log it has: a stream that does not exist has
version 0; appends with an expected version answer a stale one with ``ConflictError`` naming
the current version, and a finished episode with a ``ConflictError`` too (it is closed); a
retried batch (the same event ids) is stored once, while a reused event id with other content
is an ``IdempotencyError``; the state of a stream gives its version, final status and reward;
a run's configuration comes back as created and an unknown run is ``NotFoundError``; the
newest policy version is the highest ``policy_updated``; an engine's report of the version it
serves lands, and a bad one is refused naming what is wrong. The one documented difference: the
API does not tell checkpoint paths (``PolicyState.checkpoint`` is None through it).
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from store import errors
from store.eventlog import NO_STREAM, EventStore, run_stream_id
from store.events import (
    EgpoConfig,
    EpisodeFinished,
    EpisodeStarted,
    Event,
    PolicyUpdated,
    RewardAssigned,
    RunConfig,
    RunCreated,
    ToolReturned,
)
from store.settings import Settings
from tests.servers import ThreadedServer
from workers.rollout.group_log import ApiGroupLog, GroupLog, StoreGroupLog, StreamState

CONFIG = RunConfig(group_size=3, egpo=EgpoConfig(lam=0.2, alpha=1.5),
                   chat_template="{{ messages }}")


@dataclass
class Subject:
    name: str
    log: GroupLog
    store: EventStore
    project: str

    def new_run(self, config: RunConfig = CONFIG) -> str:
        run_id = f"run-{uuid.uuid4().hex[:10]}"
        self.store.append(run_stream_id(run_id), [RunCreated(
            run_id=run_id, project=self.project, config=config)], NO_STREAM)
        return run_id


@pytest.fixture(params=["store", "api"])
def subject(request: pytest.FixtureRequest, store: EventStore,
            settings: Settings) -> Iterator[Subject]:
    project = f"proj-{uuid.uuid4().hex[:8]}"
    if request.param == "store":
        yield Subject("store", StoreGroupLog(store), store, project)
        return
    from api.app import create_app
    from api.keys import KeyStore

    api_settings = settings.model_copy(update={"api_key_scrypt_n": 1024})
    admin = KeyStore(store.db, api_settings).create(project=project, role="admin").token
    with ThreadedServer(create_app(api_settings, store=store)) as server:
        log = ApiGroupLog(server.url, api_key=admin)
        try:
            yield Subject("api", log, store, project)
        finally:
            log.close()


def _now() -> dict[str, Any]:
    return {"event_id": uuid.uuid4(), "occurred_at": dt.datetime.now(dt.UTC)}


def _started(run_id: str) -> Event:
    return EpisodeStarted(**_now(), run_id=run_id, group_id="g-1",
                          messages=[{"role": "user", "content": "2+2?"}])


def _ending(reward: float, status: str = "completed") -> list[Event]:
    return [RewardAssigned(**_now(), value=reward),
            EpisodeFinished(**_now(), status=status, reason="done")]  # type: ignore[arg-type]


def test_a_stream_that_does_not_exist_has_version_zero(subject: Subject) -> None:
    name = f"ep-{uuid.uuid4().hex}"
    assert subject.log.stream_version(name) == 0
    state = subject.log.stream_state(name)
    assert state == StreamState(0) and not state.finished


def test_state_follows_the_stream_to_its_finish(subject: Subject) -> None:
    run_id = subject.new_run()
    episode = f"ep-{uuid.uuid4().hex}"
    subject.log.append(episode, [_started(run_id)], NO_STREAM)
    state = subject.log.stream_state(episode)
    assert (state.version, state.status, state.reward, state.finished) == (1, None, None,
                                                                          False)
    subject.log.append(episode, [ToolReturned(**_now(), name="calculator", output="4")], 1)
    subject.log.append(episode, _ending(0.5, "truncated"), 2)
    assert subject.log.stream_version(episode) == 4
    state = subject.log.stream_state(episode)
    assert (state.version, state.status, state.reason, state.reward) == (4, "truncated",
                                                                        "done", 0.5)
    assert state.finished


def test_a_stale_expected_version_is_a_conflict_naming_the_current_one(
        subject: Subject) -> None:
    run_id = subject.new_run()
    episode = f"ep-{uuid.uuid4().hex}"
    subject.log.append(episode, [_started(run_id)], NO_STREAM)
    subject.log.append(episode, [ToolReturned(**_now(), name="calculator", output="1")], 1)
    with pytest.raises(errors.ConflictError) as conflict:
        subject.log.append(episode, [ToolReturned(**_now(), name="calculator", output="2")],
                           1)
    assert conflict.value.actual == 2
    with pytest.raises(errors.ConflictError):
        subject.log.append(episode, [_started(run_id)], NO_STREAM)
    assert subject.log.stream_version(episode) == 2


def test_a_finished_episode_is_closed(subject: Subject) -> None:
    run_id = subject.new_run()
    episode = f"ep-{uuid.uuid4().hex}"
    subject.log.append(episode, [_started(run_id), *_ending(1.0)], NO_STREAM)
    with pytest.raises(errors.ConflictError):
        subject.log.append(episode, [ToolReturned(**_now(), name="calculator", output="3")],
                           3)
    assert subject.log.stream_version(episode) == 3


def test_a_retried_batch_is_stored_once_and_a_reused_id_is_refused(subject: Subject) -> None:
    run_id = subject.new_run()
    episode = f"ep-{uuid.uuid4().hex}"
    batch = [_started(run_id), ToolReturned(**_now(), name="calculator", output="4")]
    subject.log.append(episode, batch, NO_STREAM)
    subject.log.append(episode, batch, NO_STREAM)  # the retry of a lost answer
    assert subject.log.stream_version(episode) == 2
    reused = ToolReturned(event_id=batch[1].event_id, occurred_at=dt.datetime.now(dt.UTC),
                          name="calculator", output="5")
    with pytest.raises(errors.IdempotencyError):
        subject.log.append(episode, [reused], 2)
    assert subject.log.stream_version(episode) == 2


def test_run_config_comes_back_as_created(subject: Subject) -> None:
    run_id = subject.new_run()
    assert subject.log.run_config(run_id) == CONFIG
    with pytest.raises(errors.NotFoundError):
        subject.log.run_config(f"no-such-run-{uuid.uuid4().hex}")


def test_policy_is_the_newest_version(subject: Subject) -> None:
    run_id = subject.new_run()
    assert subject.log.policy(run_id).version == 0
    subject.store.append(run_stream_id(run_id), [
        PolicyUpdated(version=2, step=2, checkpoint="/ckpt/v2"),
        PolicyUpdated(version=1, step=1, checkpoint="/ckpt/v1")])
    policy = subject.log.policy(run_id)
    assert policy.version == 2
    # The one documented difference: the API does not tell checkpoint paths.
    assert policy.checkpoint == ("/ckpt/v2" if subject.name == "store" else None)


def test_engine_reports_land_alike_and_bad_ones_are_refused_alike(subject: Subject) -> None:
    from store.serving import policy_takeup

    run_id = subject.new_run()
    subject.store.append(run_stream_id(run_id), [PolicyUpdated(version=1, step=1)])
    subject.log.policy_served(run_id, version=1, engine="h:1/X", backend="X",
                              source="/ckpt/v1", load_seconds=0.5)
    assert subject.log.policy(run_id).version == 1  # reports do not move the policy
    (version,) = policy_takeup(subject.store, run_id)
    assert [(e.engine, e.backend, e.source, e.load_seconds) for e in version.engines] == [
        ("h:1/X", "X", "/ckpt/v1", 0.5)]
    with pytest.raises(errors.ValidationError, match="has no policy version 2"):
        subject.log.policy_served(run_id, version=2, engine="h:1/X", backend="X")
    with pytest.raises(errors.ValidationError, match="engine must be 1 to 200 characters"):
        subject.log.policy_served(run_id, version=1, engine=" ", backend="X")
    with pytest.raises(errors.NotFoundError):
        subject.log.policy_served(f"no-such-run-{uuid.uuid4().hex}", version=0,
                                  engine="h:1/X", backend="X")
    assert len(policy_takeup(subject.store, run_id)[0].engines) == 1
