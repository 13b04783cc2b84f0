"""The trainer side of the remote-rollout protocol takes a rollout id it has not seen: the
episode is created on the first call in the run the request names (``X-Trajstore-Run`` or
the ``/v1/runs/{run}/episodes/{id}/`` path), else the key's run, else
``TRAJSTORE_REMOTE_DEFAULT_RUN``, with the first call's tools, as the gateway creates
episodes. Nothing named: 404 naming the header and the setting. An id another project uses:
409 that names nothing of it. The tiny model is the in-process engine; the last test drives
trajstore's own RolloutServer (a real ``trajstore serve`` and rollout worker) whose calls
carry only the rollout id."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.keys import ApiKey
from store import queries
from store.eventlog import EventStore
from store.events import EpisodeStarted, LLMCalled
from store.settings import Settings
from tests.api.conftest import Project
from tests.workers.conftest import Worker

pytestmark = pytest.mark.timeout(600)

QUESTION = [{"role": "system", "content": "You are a calculator."},
            {"role": "user", "content": "What is 5 + 3?"}]
ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                     "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
# A seeded draw whose text re-encodes to the same ids (tests/api/test_remote_trainer_side.py).
DRAW = {"temperature": 1.0, "max_tokens": 4, "seed": 5}


def _settings(api_settings: Settings, tiny_model_dir: Path, **more: Any) -> Settings:
    return api_settings.model_copy(update={"gateway_engine_model": str(tiny_model_dir),
                                           "gateway_max_tokens": 16, **more})


@pytest.fixture
def default_run() -> str:
    return f"default-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def gateway(api_settings: Settings, api_store: EventStore, tiny_model_dir: Path
            ) -> Iterator[TestClient]:
    """No default run configured."""
    with TestClient(create_app(_settings(api_settings, tiny_model_dir),
                               store=api_store)) as c:
        yield c


@pytest.fixture
def defaulted(api_settings: Settings, api_store: EventStore, tiny_model_dir: Path,
              default_run: str) -> Iterator[TestClient]:
    """``remote_default_run`` set to a run nobody created yet."""
    settings = _settings(api_settings, tiny_model_dir, remote_default_run=default_run)
    with TestClient(create_app(settings, store=api_store)) as c:
        yield c


def rid() -> str:
    return f"rollout-{uuid.uuid4().hex[:10]}"


def started(store: EventStore, episode_id: str) -> EpisodeStarted:
    first = store.read_stream(episode_id, to_version=1)
    assert first, f"episode {episode_id} was not created"
    event = first[0].event
    assert isinstance(event, EpisodeStarted)
    return event


def calls(store: EventStore, episode_id: str) -> list[LLMCalled]:
    return [r.event for r in store.read_stream(episode_id) if isinstance(r.event, LLMCalled)]


def run_project(store: EventStore, run_id: str) -> str | None:
    record = queries.run_record(store, run_id)
    return None if record is None else record["data"].get("project")


def test_the_run_header_creates_the_rollout_with_the_first_calls_tools(
        gateway: TestClient, project: Project, api_store: EventStore,
        tiny_model_dir: Path) -> None:
    run_id, rollout_id = f"hdr-{uuid.uuid4().hex[:8]}", rid()
    r = gateway.post("/v1/chat/completions", headers={
        **project.headers("ingest"), "X-Trajstore-Run": run_id, "X-Trajstore-Group": "g7"},
        json={"rollout_id": rollout_id, "messages": QUESTION, "tools": [ADD_TOOL], **DRAW})
    assert r.status_code == 200, r.text
    assert r.json()["mask_check"]["status"] == "first_call"
    episode = started(api_store, rollout_id)
    assert (episode.run_id, episode.group_id, episode.tools) == (run_id, "g7", [ADD_TOOL])
    # The run was created in the key's project, with the engine's tokenizer.
    assert run_project(api_store, run_id) == project.name
    run = gateway.get(f"/v1/runs/{run_id}", headers=project.headers("read")).json()
    assert run["config"]["tokenizer"] == str(tiny_model_dir)
    # Later calls carry only the rollout id and land in the same episode.
    first = r.json()
    messages = [*QUESTION, first["choices"][0]["message"],
                {"role": "user", "content": "And 2 + 2?"}]
    again = gateway.post("/v1/chat/completions", headers=project.headers("ingest"), json={
        "rollout_id": rollout_id, "messages": messages, "tools": [ADD_TOOL], **DRAW})
    assert again.status_code == 200, again.text
    assert again.json()["mask_check"]["status"] == "ok", again.json()["mask_check"]
    assert len(calls(api_store, rollout_id)) == 2
    assert started(api_store, rollout_id).run_id == run_id


def test_the_path_names_the_run_and_must_name_the_rollout_as_its_episode(
        gateway: TestClient, project: Project, api_store: EventStore) -> None:
    run_id, rollout_id = f"path-{uuid.uuid4().hex[:8]}", rid()
    headers = project.headers("ingest")
    wrong = gateway.post(f"/v1/runs/{run_id}/episodes/other-id/completions", headers=headers,
                         json={"rollout_id": rollout_id, "messages": QUESTION, **DRAW})
    assert wrong.status_code == 422, wrong.text
    error = wrong.json()["error"]
    assert error["field"] == "body.rollout_id" and "other-id" in error["message"]
    assert api_store.read_stream(rollout_id) == [] and api_store.read_stream("other-id") == []
    assert queries.run_record(api_store, run_id) is None
    r = gateway.post(f"/v1/runs/{run_id}/episodes/{rollout_id}/completions", headers=headers,
                     json={"rollout_id": rollout_id, "messages": QUESTION, **DRAW})
    assert r.status_code == 200, r.text
    assert started(api_store, rollout_id).run_id == run_id
    assert started(api_store, rollout_id).tools == []  # the call offered none
    assert run_project(api_store, run_id) == project.name


def test_with_nothing_naming_a_run_an_unseen_rollout_is_404_naming_what_is_missing(
        gateway: TestClient, project: Project, api_store: EventStore) -> None:
    rollout_id = rid()
    r = gateway.post("/v1/completions", headers=project.headers("ingest"),
                     json={"rollout_id": rollout_id, "messages": QUESTION, **DRAW})
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert error["field"] == "header.X-Trajstore-Run"
    assert "X-Trajstore-Run" in error["message"]
    assert "TRAJSTORE_REMOTE_DEFAULT_RUN" in error["message"]
    assert api_store.read_stream(rollout_id) == []


def test_a_rollout_server_sending_only_rollout_ids_records_into_the_default_run(
        defaulted: TestClient, project: Project, api_store: EventStore, default_run: str,
        tiny_model_dir: Path) -> None:
    """The reference RolloutSession's bookkeeping: no headers but the key, a null mask first,
    then one 0 per token the conversation grew by; the masks check exact."""
    from workers.engines.render import prompt_ids
    from workers.engines.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model_dir))
    http = defaulted
    rollout_ids = [rid(), rid()]
    for rollout_id in rollout_ids:
        messages: list[dict[str, Any]] = [dict(m) for m in QUESTION]
        last_length = 0
        for turn in range(2):
            length = len(prompt_ids(tokenizer, messages, tools=[ADD_TOOL]))
            mask = None if turn == 0 else [0] * (length - last_length)
            r = http.post("/v1/chat/completions", headers=project.headers("ingest"), json={
                "model": "default", "rollout_id": rollout_id, "messages": messages,
                "tools": [ADD_TOOL], "response_mask": mask, **DRAW})
            assert r.status_code == 200, r.text
            body = r.json()
            assert len(body["prompt_token_ids"]) == length
            assert body["mask_check"]["status"] == ("first_call" if turn == 0 else "ok"), \
                body["mask_check"]
            last_length = length + len(body["token_ids"])
            messages += [body["choices"][0]["message"],
                         {"role": "user", "content": "And 2 + 2?"}]
        episode = started(api_store, rollout_id)
        assert (episode.run_id, episode.group_id, episode.tools) == \
            (default_run, rollout_id, [ADD_TOOL])
        recorded = calls(api_store, rollout_id)
        assert [c.response["mask_check"]["status"] for c in recorded] == ["first_call", "ok"]
    assert run_project(api_store, default_run) == project.name
    listed = http.get("/v1/episodes", params={"run_id": default_run},
                      headers=project.headers("read"))
    assert listed.status_code == 200, listed.text
    assert {e["episode_id"] for e in listed.json()["episodes"]} == set(rollout_ids)
    # A header still wins over the default.
    named, rollout_id = f"named-{uuid.uuid4().hex[:8]}", rid()
    r = http.post("/v1/chat/completions", headers={**project.headers("ingest"),
                                                   "X-Trajstore-Run": named},
                  json={"rollout_id": rollout_id, "messages": QUESTION, **DRAW})
    assert r.status_code == 200, r.text
    assert started(api_store, rollout_id).run_id == named


def test_a_rollout_id_of_another_project_is_a_conflict_that_names_nothing_of_it(
        defaulted: TestClient, project: Project, other_project: Project,
        api_store: EventStore) -> None:
    theirs, rollout_id = f"secret-run-{uuid.uuid4().hex[:8]}", rid()
    r = defaulted.post("/v1/chat/completions", headers={**other_project.headers("ingest"),
                                                        "X-Trajstore-Run": theirs},
                       json={"rollout_id": rollout_id, "messages": QUESTION, **DRAW})
    assert r.status_code == 200, r.text
    before = api_store.stream_version(rollout_id)
    attempts = [
        ("/v1/chat/completions", {}),  # the default run
        ("/v1/completions", {"X-Trajstore-Run": f"mine-{uuid.uuid4().hex[:6]}"}),
        (f"/v1/runs/mine-{uuid.uuid4().hex[:6]}/episodes/{rollout_id}/chat/completions", {}),
    ]
    for path, extra in attempts:
        got = defaulted.post(path, headers={**project.headers("ingest"), **extra},
                             json={"rollout_id": rollout_id, "messages": QUESTION, **DRAW})
        assert got.status_code == 409, (path, got.text)
        error = got.json()["error"]
        assert error["code"] == "rollout_id_taken" and error["field"] == "body.rollout_id"
        assert other_project.name not in got.text and theirs not in got.text
    assert api_store.stream_version(rollout_id) == before
    for _, extra in attempts[1:2]:
        assert queries.run_record(api_store, extra["X-Trajstore-Run"]) is None


def test_a_run_of_another_project_named_by_the_request_is_403(
        gateway: TestClient, project: Project, other_project: Project,
        api_store: EventStore) -> None:
    theirs = f"theirs-{uuid.uuid4().hex[:8]}"
    r = gateway.post("/v1/runs", headers=other_project.headers("ingest"),
                     json={"run_id": theirs, "config": {}})
    assert r.status_code == 201, r.text
    rollout_id = rid()
    got = gateway.post("/v1/chat/completions", headers={**project.headers("ingest"),
                                                        "X-Trajstore-Run": theirs},
                       json={"rollout_id": rollout_id, "messages": QUESTION, **DRAW})
    assert got.status_code == 403, got.text
    assert api_store.read_stream(rollout_id) == []


def test_a_key_scoped_to_a_run_names_the_run_after_the_request(
        defaulted: TestClient, default_run: str) -> None:
    gateway = defaulted.app.state.ctx.gateway  # type: ignore[attr-defined]
    import datetime as dt

    now = dt.datetime.now(dt.UTC)
    plain = ApiKey("0" * 16, "p", "ingest", None, now)
    scoped = ApiKey("1" * 16, "p", "ingest", None, now, run_id="scoped-run")
    assert gateway.remote_run(plain, "asked") == ("asked", "header.X-Trajstore-Run")
    assert gateway.remote_run(plain, None) == (default_run, "TRAJSTORE_REMOTE_DEFAULT_RUN")
    assert gateway.remote_run(scoped, None) == ("scoped-run", "the key's run")
    assert gateway.remote_run(scoped, "scoped-run")[0] == "scoped-run"
    from api.errors import ApiError

    with pytest.raises(ApiError) as refused:
        gateway.remote_run(scoped, "another-run")
    assert refused.value.status == 403 and "scoped-run" in refused.value.message


def test_settings_refuse_a_default_run_that_is_no_id(tmp_path: Path) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="remote_default_run"):
        Settings(data_dir=tmp_path, remote_default_run="no spaces/allowed")
    assert Settings(data_dir=tmp_path, remote_default_run="").remote_default_run is None


def test_trajstores_own_rollout_server_calls_back_with_only_the_rollout_id(
        api_settings: Settings, start_server: Any, project: Project, api_store: EventStore,
        tiny_model_dir: Path, rollout_broker: str, rollout_worker: Worker,
        default_run: str) -> None:
    """``POST /rollout`` to a real server: a rollout worker plays the rollout as the
    RolloutServer and calls this same server's completions endpoint back with the rollout id
    and the callback key alone; the trainer side creates the rollout in the default run."""
    import httpx

    server = start_server(TRAJSTORE_REDIS_URL=rollout_broker,
                          TRAJSTORE_GATEWAY_ENGINE_MODEL=str(tiny_model_dir),
                          TRAJSTORE_GATEWAY_MAX_TOKENS="16",
                          TRAJSTORE_REMOTE_DEFAULT_RUN=default_run)
    with httpx.Client(base_url=server.url, timeout=300,
                      headers=project.headers("ingest")) as http:
        server_run = f"rs-{uuid.uuid4().hex[:8]}"
        r = http.post("/v1/runs", json={"run_id": server_run,
                                        "config": {"tokenizer": str(tiny_model_dir)}})
        assert r.status_code == 201, r.text
        rollout_id = rid()
        r = http.post("/rollout", json={
            "rollout_id": rollout_id, "server_url": server.url, "messages": QUESTION,
            "sampling_params": {"temperature": 0, "max_tokens": 8},
            "tokenizer_name": str(tiny_model_dir), "max_turns": 2,
            "callback_api_key": project.ingest, "run_id": server_run})
        assert r.status_code == 200, r.text
        body = r.json()
    assert body["status"] == "COMPLETED", body
    trainer_side = calls(api_store, rollout_id)
    assert len(trainer_side) == body["metrics"]["llm_calls"] >= 1
    assert started(api_store, rollout_id).run_id == default_run
    assert run_project(api_store, default_run) == project.name
    statuses = [c.response["mask_check"]["status"] for c in trainer_side]
    assert statuses[0] == "first_call"
    assert body["metrics"]["prompt_length_mismatches"] == 0
    server_side = [r.type for r in api_store.read_stream(body["episode_id"])]
    assert server_side[0] == "episode_started" and server_side[-1] == "episode_finished"
