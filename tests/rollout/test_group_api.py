"""A group rolled out through the HTTP API (``ApiGroupLog``) against the real API app served by
uvicorn: events land in the store like direct appends, a second delivery plays nothing, and
the API's refusals come back as the store's errors."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from api.app import create_app
from api.keys import KeyStore
from store import errors
from store.db import Database
from store.eventlog import NO_STREAM, EventStore, run_stream_id
from store.events import PolicyUpdated, RunConfig, RunCreated, ToolReturned
from store.settings import Settings
from tests.servers import ThreadedServer, free_port
from workers.engines.backend import SamplingParams
from workers.engines.backend_transformers import TransformersBackend
from workers.rollout.agent_tasks import arithmetic_tasks
from workers.rollout.group import group_id_for, play_group
from workers.rollout.group_log import ApiGroupLog, PolicyState, StoreGroupLog
from workers.rollout.tools import ToolRegistry

TASK = arithmetic_tasks(1, seed=9)[0]


@pytest.fixture
def api(tmp_path: Path, pg_url: str) -> Iterator[tuple[str, EventStore, Settings]]:
    settings = Settings(database_url=pg_url, data_dir=tmp_path, api_key_scrypt_n=1024)
    store = EventStore(Database(pg_url, max_size=4), settings)
    with ThreadedServer(create_app(settings, store=store)) as server:
        yield server.url, store, settings
    store.close()


def test_group_through_the_api(api: tuple[str, EventStore, Settings],
                               hf_backend: TransformersBackend,
                               registry: ToolRegistry) -> None:
    url, store, settings = api
    project = f"proj-{uuid.uuid4().hex[:8]}"
    keys = KeyStore(store.db, settings)
    admin = keys.create(project=project, role="admin").token
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    store.append(run_stream_id(run_id), [RunCreated(
        run_id=run_id, project=project, config=RunConfig(group_size=2))], NO_STREAM)
    store.append(run_stream_id(run_id), [PolicyUpdated(version=3, step=3, checkpoint="/x")])

    log = ApiGroupLog(url, api_key=admin)
    try:
        assert log.run_config(run_id) == RunConfig(group_size=2)
        assert log.policy(run_id) == PolicyState(3, None)

        def play() -> Any:
            return play_group(log=log, run_id=run_id, task=TASK, backend=hf_backend,
                              tools=registry, policy_version=3,
                              sampling=SamplingParams(max_tokens=24), max_turns=2)

        result = play()
        assert result.played == 2
        assert result.group_id == group_id_for(run_id, TASK.task_id, 3, 0)
        direct = StoreGroupLog(store)
        for slot in result.slots:
            events = store.get_episode(slot.episode_id)
            assert [e.type for e in events[-2:]] == ["reward_assigned", "episode_finished"]
            assert events[0].event.policy_version == 3
            calls = [e.event for e in events if e.type == "llm_called"]
            assert calls and calls[0].response_ids.size == calls[0].logprobs.size
            assert log.stream_state(slot.episode_id) == direct.stream_state(slot.episode_id)
            # What a resume reads: the same events, token payloads included.
            through_api = log.stream_events(slot.episode_id)
            stored = direct.stream_events(slot.episode_id)
            assert [e.event_id for e in through_api] == [e.event_id for e in stored]
            assert [e.to_data() for e in through_api] == [e.to_data() for e in stored]
            for mine, theirs in zip(through_api, stored, strict=True):
                for name, array in theirs.token_payloads().items():
                    assert mine.token_payloads()[name].tolist() == array.tolist()
        assert log.stream_events("no-such-episode") == []
        assert play().played == 0
        assert len(store.list_episodes(run_id)) == 2
        assert log.stream_version("no-such-episode") == 0

        stream = result.slots[0].episode_id
        with pytest.raises(errors.ConflictError) as conflict:
            log.append(stream, [ToolReturned(name="calculator", output="1",
                                             event_id=uuid.uuid4())], 1)
        assert conflict.value.actual == store.stream_version(stream)
        with pytest.raises(errors.NotFoundError):
            log.run_config("no-such-run")
    finally:
        log.close()

    ingest_only = ApiGroupLog(url, api_key=keys.create(project=project, role="ingest").token)
    with pytest.raises(errors.StoreError, match="403"):
        ingest_only.run_config(run_id)
    ingest_only.close()
    unreachable = ApiGroupLog(f"http://127.0.0.1:{free_port()}", api_key="k")
    with pytest.raises(errors.TransientError):
        unreachable.policy(run_id)
    with pytest.raises(ValueError, match="api_url"):
        ApiGroupLog("ftp://x", api_key="k")
    with pytest.raises(ValueError, match="api_key"):
        ApiGroupLog(url, api_key="")


def test_engine_reports_its_policy_version_through_the_api(
        api: tuple[str, EventStore, Settings]) -> None:
    from store.serving import policy_takeup

    url, store, settings = api
    project = f"proj-{uuid.uuid4().hex[:8]}"
    admin = KeyStore(store.db, settings).create(project=project, role="admin").token
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    store.append(run_stream_id(run_id), [RunCreated(run_id=run_id, project=project)],
                 NO_STREAM)
    store.append(run_stream_id(run_id), [PolicyUpdated(version=1, step=1)])
    log = ApiGroupLog(url, api_key=admin)
    try:
        log.policy_served(run_id, version=1, engine="far:7/AsyncVLLMBackend",
                          backend="AsyncVLLMBackend", source="/shared/v1", load_seconds=0.5)
        (version,) = policy_takeup(store, run_id)
        (engine,) = version.engines
        assert (engine.engine, engine.source, engine.load_seconds) == (
            "far:7/AsyncVLLMBackend", "/shared/v1", 0.5)
        # The API's refusals come back as the store's errors, naming what is wrong.
        with pytest.raises(errors.ValidationError, match="has no policy version 2"):
            log.policy_served(run_id, version=2, engine="far:7/X", backend="X")
        with pytest.raises(errors.ValidationError, match="greater than or equal to 0"):
            log.policy_served(run_id, version=-1, engine="far:7/X", backend="X")
        with pytest.raises(errors.NotFoundError):
            log.policy_served("no-such-run", version=0, engine="far:7/X", backend="X")
        assert len(policy_takeup(store, run_id)[0].engines) == 1
    finally:
        log.close()
