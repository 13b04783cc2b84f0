"""The capture gateway in real ``trajstore serve`` processes, driven by the official
``openai`` client: the in-process engine (the tiny model), and a second gateway forwarding
to the first as its upstream server. Every recorded call carries the engine's exact token
ids and logprobs; streamed calls are recorded once complete; upstream failures pass through
and record nothing."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from api.app import create_app
from api.keys import KeyStore
from store.db import Database
from store.eventlog import EventStore
from store.events import LLMCalled
from store.settings import Settings
from tests.api.conftest import Project, Server, make_project

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_dir: Path) -> Any:
    from workers.engines.tokenizers import load_tokenizer

    return load_tokenizer(str(tiny_model_dir))


@pytest.fixture(scope="module")
def module_settings(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    return Settings(database_url=pg_url, data_dir=tmp_path_factory.mktemp("gateway"),
                    api_key_scrypt_n=1024)


@pytest.fixture(scope="module")
def engine_server(module_settings: Settings, tiny_model_dir: Path) -> Iterator[Server]:
    server = Server(module_settings, module_settings.data_dir / "engine.log",
                    TRAJSTORE_GATEWAY_ENGINE_MODEL=str(tiny_model_dir),
                    TRAJSTORE_GATEWAY_MAX_TOKENS="64")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture
def episode(api_store: EventStore, project: Project, tiny_model_dir: Path,
            client: TestClient) -> str:
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    r = client.post("/v1/runs", json={"run_id": run_id,
                                      "config": {"group_size": 1,
                                                 "tokenizer": str(tiny_model_dir)}},
                    headers=project.headers("ingest"))
    assert r.status_code == 201, r.text
    r = client.post(f"/v1/runs/{run_id}/episodes", json={"group_id": "g0"},
                    headers=project.headers("ingest"))
    return str(r.json()["episode_id"])


def calls(store: EventStore, episode: str) -> list[LLMCalled]:
    return [r.event for r in store.read_stream(episode) if isinstance(r.event, LLMCalled)]


MESSAGES = [{"role": "system", "content": "You are a calculator."},
            {"role": "user", "content": "What is 2 + 3? Use the calculator tool."}]


def rendered(tokenizer: Any, messages: list[dict[str, Any]], tools: Any = None) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tools=tools, tokenize=True,
                                              add_generation_prompt=True, return_dict=False))


def check_chat_capture(store: EventStore, episode: str, tokenizer: Any,
                       answer: Any) -> LLMCalled:
    """The last recorded call is ``answer``, with the prompt the tiny tokenizer renders."""
    event = calls(store, episode)[-1]
    assert event.prompt_ids.tolist() == rendered(tokenizer, MESSAGES)
    assert len(event.response_ids) == answer.usage.completion_tokens == len(event.logprobs)
    assert answer.usage.prompt_tokens == len(event.prompt_ids)
    message = answer.choices[0].message
    assert event.response.get("content") == message.content
    text = tokenizer.decode(event.response_ids.tolist(), skip_special_tokens=True)
    assert message.content in text
    assert (event.logprobs <= 0).all()
    return event


def test_openai_client_through_the_in_process_engine(
        engine_server: Server, project: Project, episode: str, api_store: EventStore,
        tiny_tokenizer: Any) -> None:
    client = OpenAI(base_url=engine_server.url + "/v1", api_key=project.ingest,
                    default_headers={"X-Trajstore-Episode": episode,
                                     "X-Trajstore-Agent": "solver"})
    plain = client.chat.completions.create(model="trajstore", messages=MESSAGES,
                                           max_tokens=12, seed=1)
    event = check_chat_capture(api_store, episode, tiny_tokenizer, plain)
    assert event.agent == "solver" and plain.choices[0].logprobs is None
    assert "token_ids" not in (plain.choices[0].model_extra or {})

    # Asking for logprobs and token ids: the caller sees exactly what was recorded.
    rich = client.chat.completions.create(
        model="trajstore", messages=MESSAGES, max_tokens=12, seed=2, logprobs=True,
        extra_body={"return_token_ids": True})
    event = check_chat_capture(api_store, episode, tiny_tokenizer, rich)
    choice = rich.choices[0]
    assert choice.model_extra["token_ids"] == event.response_ids.tolist()
    assert rich.model_extra["prompt_token_ids"] == event.prompt_ids.tolist()
    assert np.allclose([t.logprob for t in choice.logprobs.content], event.logprobs)

    # Streamed: recorded once complete, content as streamed.
    stream = client.chat.completions.create(model="trajstore", messages=MESSAGES,
                                            max_tokens=12, seed=3, stream=True,
                                            stream_options={"include_usage": True})
    pieces, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                pieces.append(c.delta.content)
    event = calls(api_store, episode)[-1]
    assert len(calls(api_store, episode)) == 3
    assert event.response["content"] == "".join(pieces)
    assert usage is not None and usage.completion_tokens == len(event.response_ids)

    # Text completions, plain and streamed.
    done = client.completions.create(model="trajstore", prompt="What is 2 + 3?",
                                     max_tokens=8, seed=4, logprobs=0)
    event = calls(api_store, episode)[-1]
    assert event.prompt_ids.tolist() == tiny_tokenizer("What is 2 + 3?",
                                                       add_special_tokens=False)["input_ids"]
    assert done.choices[0].text == event.response["content"]
    assert np.allclose(done.choices[0].logprobs.token_logprobs, event.logprobs)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="trajstore", prompt="What is 2 + 3?", max_tokens=8, seed=5, stream=True)
        if c.choices)
    assert calls(api_store, episode)[-1].response["content"] == streamed
    assert len(calls(api_store, episode)) == 5

    # Without an episode nothing is recorded; an unknown episode is a 404.
    bare = OpenAI(base_url=engine_server.url + "/v1", api_key=project.ingest)
    bare.chat.completions.create(model="trajstore", messages=MESSAGES, max_tokens=4)
    assert len(calls(api_store, episode)) == 5
    with pytest.raises(openai.NotFoundError):
        bare.chat.completions.create(model="trajstore", messages=MESSAGES, max_tokens=4,
                                     extra_headers={"X-Trajstore-Episode": "nope"})
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=engine_server.url + "/v1", api_key="wrong").chat.completions.create(
            model="trajstore", messages=MESSAGES, max_tokens=4)


def test_recorded_calls_replay_into_trainable_timelines(
        engine_server: Server, project: Project, episode: str, api_store: EventStore,
        client: TestClient) -> None:
    oa = OpenAI(base_url=engine_server.url + "/v1", api_key=project.ingest,
                default_headers={"X-Trajstore-Episode": episode})
    first = oa.chat.completions.create(model="m", messages=MESSAGES, max_tokens=10, seed=7)
    follow = [*MESSAGES, {"role": "assistant", "content": first.choices[0].message.content},
              {"role": "user", "content": "Thanks. And 4 + 4?"}]
    oa.chat.completions.create(model="m", messages=follow, max_tokens=10, seed=8)
    got = client.get(f"/v1/episodes/{episode}/timelines", headers=project.headers("read"))
    assert got.status_code == 200, got.text
    recorded = calls(api_store, episode)
    timelines = got.json()["timelines"]
    (merged,) = timelines  # the first call is a prefix of the second: one sample
    mask = np.asarray(merged["loss_mask"], dtype=bool)
    ids = np.asarray(merged["token_ids"])
    generated = np.concatenate([c.response_ids for c in recorded])
    assert ids[mask].tolist() == generated.tolist()


@pytest.fixture(scope="module")
def forwarding_server(module_settings: Settings, engine_server: Server) -> Iterator[Server]:
    store = EventStore(Database(module_settings.database_url or "", max_size=1),
                       module_settings)
    upstream_key = make_project(KeyStore(store.db, module_settings)).ingest
    store.close()
    server = Server(module_settings, module_settings.data_dir / "forwarding.log",
                    TRAJSTORE_GATEWAY_UPSTREAM_URL=engine_server.url,
                    TRAJSTORE_GATEWAY_UPSTREAM_API_KEY=upstream_key)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_gateway_forwarding_to_an_upstream_server(
        forwarding_server: Server, project: Project, episode: str, api_store: EventStore,
        tiny_tokenizer: Any) -> None:
    client = OpenAI(base_url=forwarding_server.url + "/v1", api_key=project.ingest,
                    default_headers={"X-Trajstore-Episode": episode})
    plain = client.chat.completions.create(model="trajstore", messages=MESSAGES,
                                           max_tokens=10, seed=1)
    event = check_chat_capture(api_store, episode, tiny_tokenizer, plain)
    # The gateway asked upstream for ids and logprobs; the caller did not, and gets none.
    assert plain.choices[0].logprobs is None
    assert "token_ids" not in (plain.choices[0].model_extra or {})
    assert "prompt_token_ids" not in (plain.model_extra or {})
    rich = client.chat.completions.create(model="trajstore", messages=MESSAGES, max_tokens=10,
                                          seed=1, extra_body={"return_token_ids": True})
    again = calls(api_store, episode)[-1]
    assert rich.choices[0].model_extra["token_ids"] == again.response_ids.tolist()
    assert again.response_ids.tolist() == event.response_ids.tolist()  # same seed

    chunks = list(client.chat.completions.create(model="trajstore", messages=MESSAGES,
                                                 max_tokens=10, seed=1, stream=True))
    streamed = calls(api_store, episode)[-1]
    assert len(calls(api_store, episode)) == 3
    assert streamed.response_ids.tolist() == event.response_ids.tolist()
    assert np.allclose(streamed.logprobs, event.logprobs, atol=1e-5)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        streamed.response["content"]
    assert all("token_ids" not in (c.choices[0].model_extra or {}) for c in chunks
               if c.choices)

    completion = client.completions.create(model="trajstore", prompt="2 + 3 =", max_tokens=6,
                                           seed=3)
    assert calls(api_store, episode)[-1].response["content"] == completion.choices[0].text

    # The upstream refuses (its max_tokens limit is 64): its status and body come back and
    # nothing is recorded.
    before = api_store.stream_version(episode)
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        client.chat.completions.create(model="trajstore", messages=MESSAGES, max_tokens=500)
    assert "max_tokens 500" in str(refused.value)
    assert api_store.stream_version(episode) == before


@pytest.fixture
def unreachable_upstream(api_settings: Settings, api_store: EventStore
                         ) -> Iterator[TestClient]:
    from tests.servers import free_port

    settings = api_settings.model_copy(update={
        "gateway_upstream_url": f"http://127.0.0.1:{free_port()}"})
    with TestClient(create_app(settings, store=api_store)) as c:
        yield c


def test_unreachable_upstream_is_502_and_records_nothing(
        unreachable_upstream: TestClient, project: Project, episode: str,
        api_store: EventStore) -> None:
    before = api_store.stream_version(episode)
    r = unreachable_upstream.post("/v1/chat/completions", json={
        "messages": MESSAGES, "max_tokens": 4}, headers={
        **project.headers("ingest"), "X-Trajstore-Episode": episode})
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unreachable"
    assert api_store.stream_version(episode) == before


def test_no_backend_configured_is_503(client: TestClient, project: Project) -> None:
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES},
                    headers=project.headers("ingest"))
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_engine"


def test_finished_episode_takes_no_more_calls(client: TestClient, project: Project,
                                              episode: str) -> None:
    r = client.post(f"/v1/episodes/{episode}/events", json={
        "expected_version": 1, "events": [{"type": "episode_finished", "status": "aborted"}]},
        headers=project.headers("ingest"))
    assert r.status_code == 200
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES},
                    headers={**project.headers("ingest"), "X-Trajstore-Episode": episode})
    assert r.status_code == 409 and r.json()["error"]["code"] == "episode_finished"


def test_health_and_ready_on_a_live_server(engine_server: Server) -> None:
    assert httpx.get(engine_server.url + "/health").json() == {"status": "healthy"}
    ready = httpx.get(engine_server.url + "/ready")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    assert ready.json()["revision"] == ready.json()["head"]
