"""One tool call, one fact: the capture gateway's ``tool_returned`` (derived from the tool
message of the next request) and the agent's ``execute_tool`` span of the same call (same
episode, same tool call id) are stored once, whichever arrives first, however often; a tool
call id issued again for another call is another fact. The app in process with the tiny
model as its engine; spans as OTLP JSON."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.call_ids import tool_event_id
from store.eventlog import EventStore
from store.events import ToolReturned
from tests.api.conftest import Project
from tests.api.test_otlp import T0, export, json_span, post

pytestmark = pytest.mark.timeout(600)

QUESTION = {"role": "user", "content": "What is 2 + 3?"}


def _chat(gateway: TestClient, project: Project, run: str, episode: str,
          messages: list[dict[str, Any]]) -> None:
    r = gateway.post(f"/v1/runs/{run}/episodes/{episode}/chat/completions",
                     json={"model": "tiny", "messages": messages, "max_tokens": 4},
                     headers=project.headers("ingest"))
    assert r.status_code == 200, r.text


def _history(call_id: str, arguments: dict[str, Any], output: str) -> list[dict[str, Any]]:
    return [QUESTION,
            {"role": "assistant", "content": "", "tool_calls": [{
                "id": call_id, "type": "function",
                "function": {"name": "add", "arguments": json.dumps(arguments)}}]},
            {"role": "tool", "tool_call_id": call_id, "content": output}]


def _tool_span(episode: str, run: str, call_id: str, arguments: dict[str, Any],
               output: str, at: int = 0) -> bytes:
    """An ``execute_tool`` span alone (no agent span, which would finish the episode)."""
    return json.dumps(export(json_span(
        uuid.uuid4().hex, uuid.uuid4().hex[:16], "execute_tool add", T0 + at, {
            "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "add",
            "gen_ai.conversation.id": episode, "trajstore.run_id": run,
            "gen_ai.tool.call.id": call_id,
            "gen_ai.tool.call.arguments": json.dumps(arguments),
            "gen_ai.tool.call.result": output}))).encode()


def _tools(store: EventStore, episode: str) -> list[ToolReturned]:
    return [r.event for r in store.read_stream(episode)  # type: ignore[misc]
            if isinstance(r.event, ToolReturned)]


def _send(client: TestClient, project: Project, body: bytes) -> None:
    answer = post(client, project, body, content_type="application/json")
    assert answer.status_code == 200, answer.text


def test_gateway_first_then_the_span(gateway: TestClient, project: Project,
                                     api_store: EventStore) -> None:
    run, episode = f"run-{uuid.uuid4().hex[:8]}", f"ep-{uuid.uuid4().hex[:10]}"
    _chat(gateway, project, run, episode, [QUESTION])
    _chat(gateway, project, run, episode, _history("call-7", {"a": 2, "b": 3}, "5"))
    (fact,) = _tools(api_store, episode)
    assert fact.event_id == tool_event_id(episode, "call-7")
    for _ in range(2):  # and an exporter's retry
        _send(gateway, project, _tool_span(episode, run, "call-7", {"a": 2, "b": 3}, "5"))
        assert [t.event_id for t in _tools(api_store, episode)] == [fact.event_id]


def test_the_span_first_then_the_gateway(gateway: TestClient, project: Project,
                                         api_store: EventStore) -> None:
    run, episode = f"run-{uuid.uuid4().hex[:8]}", f"ep-{uuid.uuid4().hex[:10]}"
    _chat(gateway, project, run, episode, [QUESTION])
    _send(gateway, project, _tool_span(episode, run, "call-8", {"a": 2, "b": 3}, "5"))
    (fact,) = _tools(api_store, episode)
    assert fact.event_id == tool_event_id(episode, "call-8") and fact.duration_ms is not None
    _chat(gateway, project, run, episode, _history("call-8", {"a": 2, "b": 3}, "5"))
    assert [t.event_id for t in _tools(api_store, episode)] == [fact.event_id]
    assert [r.type for r in api_store.read_stream(episode)] == [
        "episode_started", "llm_called", "tool_returned", "llm_called"]


def test_a_tool_call_id_issued_again_for_another_call_is_another_fact(
        client: TestClient, project: Project, api_store: EventStore) -> None:
    """Spans alone, from an agent whose model numbers its calls ``call_0`` every turn: the
    second call under that id has other arguments, so it is its own fact; the first one
    sent again is still one."""
    run, episode = f"run-{uuid.uuid4().hex[:8]}", f"ep-{uuid.uuid4().hex[:10]}"
    first = _tool_span(episode, run, "call_0", {"a": 2, "b": 3}, "5")
    _send(client, project, first)
    _send(client, project, _tool_span(episode, run, "call_0", {"a": 5, "b": 4}, "9",
                                      at=20_000_000))
    _send(client, project, first)
    tools = _tools(api_store, episode)
    assert [(t.tool_call_id, t.arguments, t.output) for t in tools] == [
        ("call_0", {"a": 2, "b": 3}, "5"), ("call_0", {"a": 5, "b": 4}, "9")]
    assert tools[0].event_id == tool_event_id(episode, "call_0")
    assert tools[1].event_id != tools[0].event_id


def test_the_same_id_in_two_episodes_is_two_facts(client: TestClient, project: Project,
                                                  api_store: EventStore) -> None:
    run = f"run-{uuid.uuid4().hex[:8]}"
    episodes = [f"ep-{uuid.uuid4().hex[:10]}" for _ in range(2)]
    for episode in episodes:
        _send(client, project, _tool_span(episode, run, "call_0", {"a": 2, "b": 3}, "5"))
    assert [len(_tools(api_store, e)) for e in episodes] == [1, 1]
