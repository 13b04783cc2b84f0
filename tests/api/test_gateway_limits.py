"""The gateway's stop list and tools are capped (settings), refused with 422 naming the limit
and its setting before anything is created or generated; a refused flood costs a neighbour
nothing."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from store import queries
from store.eventlog import EventStore
from store.settings import Settings
from tests.api.conftest import Project

TOOL = {"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                         "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture
def small_gateway(api_settings: Settings, api_store: EventStore, tiny_model_dir: Path
                  ) -> Iterator[TestClient]:
    """The in-process tiny engine with low caps: 3 stop strings of 8 bytes, 2 tools of
    200 bytes."""
    settings = api_settings.model_copy(update={
        "gateway_engine_model": str(tiny_model_dir), "gateway_max_tokens": 8,
        "gateway_max_stop": 3, "gateway_max_stop_bytes": 8, "gateway_max_tools": 2,
        "gateway_max_tool_bytes": 200})
    with TestClient(create_app(settings, store=api_store)) as c:
        yield c


def _call(client: TestClient, project: Project, run: str, episode: str,
          **body: Any) -> Any:
    return client.post(f"/v1/runs/{run}/episodes/{episode}/chat/completions",
                       headers=project.headers("ingest"),
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                             **body})


@pytest.mark.parametrize(("body", "field", "setting", "limit"), [
    ({"stop": ["a", "b", "c", "d"]}, "body.stop", "gateway_max_stop", 3),
    ({"stop": ["ok", "123456789"]}, "body.stop[1]", "gateway_max_stop_bytes", 8),
    ({"stop": "ééééé"}, "body.stop", "gateway_max_stop_bytes", 8),  # 10 bytes, 5 characters
    ({"tools": [TOOL, TOOL, TOOL]}, "body.tools", "gateway_max_tools", 2),
    ({"tools": [TOOL, {**TOOL, "pad": "x" * 200}]}, "body.tools[1]", "gateway_max_tool_bytes",
     200),
])
def test_over_a_cap_is_422_naming_it_and_creates_nothing(
        small_gateway: TestClient, project: Project, api_store: EventStore,
        body: dict[str, Any], field: str, setting: str, limit: int) -> None:
    run, episode = f"run-{uuid.uuid4().hex[:8]}", f"ep-{uuid.uuid4().hex[:8]}"
    r = _call(small_gateway, project, run, episode, **body)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "limit_exceeded" and error["field"] == field
    assert error["setting"] == setting and error["limit"] == limit
    assert setting in error["message"] and str(limit) in error["message"]
    assert queries.run_record(api_store, run) is None
    assert api_store.stream_version(episode) == 0


def test_at_the_caps_a_call_goes_through(small_gateway: TestClient, project: Project,
                                         api_store: EventStore) -> None:
    run, episode = f"run-{uuid.uuid4().hex[:8]}", f"ep-{uuid.uuid4().hex[:8]}"
    r = _call(small_gateway, project, run, episode, stop=["a", "12345678", "ü"],
              tools=[TOOL, TOOL])
    assert r.status_code == 200, r.text
    assert api_store.stream_version(episode) >= 2  # episode_started, llm_called


def test_a_stop_flood_is_refused_at_once_and_a_neighbour_is_served(
        gateway: TestClient, project: Project, other_project: Project) -> None:
    """The default cap (16 strings): 10,000 stop strings are refused in well under a second,
    and another project's ordinary call right after is answered as usual."""
    flood = [f"s{i}" for i in range(10_000)]
    started = time.perf_counter()
    r = gateway.post("/v1/chat/completions", headers=project.headers("ingest"), json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stop": flood})
    refused_s = time.perf_counter() - started
    assert r.status_code == 422 and r.json()["error"]["setting"] == "gateway_max_stop"
    assert "16" in r.json()["error"]["message"]
    assert refused_s < 2.0, refused_s
    tools = [{**TOOL, "function": {**TOOL["function"], "name": f"t{i}"}} for i in range(129)]
    r = gateway.post("/v1/chat/completions", headers=project.headers("ingest"), json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": tools})
    assert r.status_code == 422 and r.json()["error"]["setting"] == "gateway_max_tools"
    started = time.perf_counter()
    ok = gateway.post("/v1/chat/completions", headers=other_project.headers("ingest"), json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "stop": [f"s{i}" for i in range(16)]})
    assert ok.status_code == 200, ok.text
    assert time.perf_counter() - started < 30


@pytest.mark.parametrize(("name", "value"), [
    ("TRAJSTORE_GATEWAY_MAX_STOP", "-1"), ("TRAJSTORE_GATEWAY_MAX_STOP_BYTES", "0"),
    ("TRAJSTORE_GATEWAY_MAX_TOOLS", "many"), ("TRAJSTORE_GATEWAY_MAX_TOOL_BYTES", "10"),
    ("TRAJSTORE_TOKENIZER_CACHE_SIZE", "0"),
])
def test_bad_limit_settings_are_refused(monkeypatch: pytest.MonkeyPatch, name: str,
                                        value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name.removeprefix("TRAJSTORE_").lower()):
        Settings()
