"""What a gateway call's history says beside the call: the agent's tool results become
``tool_returned`` facts (once each, errors classified) that analytics count, and a call the
client abandoned (``X-Trajstore-Abandoned``) becomes a negative sample, never a positive one.
A real ``trajstore serve`` with the tiny model as its engine, driven by the ``openai`` client
as an agent loop would drive it."""

from __future__ import annotations

import json
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from api.gateway.tool_facts import classify_output, tool_results
from store.eventlog import EventStore
from store.events import AttemptFailed, LLMCalled, RolledBack, ToolReturned
from store.settings import Settings
from tests.api.conftest import Project, Server, serve_tiny_engine
from trajstore.client import TrajstoreClient
from workers.replay.jobs.project import project_episode

pytestmark = [pytest.mark.timeout(600)]

TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"the {name} tool",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}}}
    for name in ("python", "search")]


@pytest.fixture(scope="module")
def module_settings(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    return Settings(database_url=pg_url, data_dir=tmp_path_factory.mktemp("gateway-facts"),
                    api_key_scrypt_n=1024)


@pytest.fixture(scope="module")
def server(module_settings: Settings, tiny_model_dir: Path) -> Iterator[Server]:
    yield from serve_tiny_engine(module_settings, tiny_model_dir,
                                 module_settings.data_dir / "engine.log")


def run_python(code: str) -> str:
    """The agent's python tool: what the code prints, or the traceback it raised."""
    scope: dict[str, Any] = {}
    try:
        exec(code, scope)  # noqa: S102 - the agent's own tool, on the test's own code
    except Exception:
        return traceback.format_exc()
    return str(scope.get("result", ""))


def call(name: str, call_id: str, **arguments: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


def assistant(answer: Any, *calls: dict[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": answer.choices[0].message.content or "",
            "tool_calls": list(calls)}


def events(store: EventStore, episode: str) -> list[Any]:
    return [r.event for r in store.read_stream(episode)]


def test_classify_output_rule() -> None:
    trace = run_python("result = 1 / 0")
    assert classify_output(trace) == (True, "ZeroDivisionError", "division by zero")
    assert classify_output("json.decoder.JSONDecodeError: Expecting value")[:2] == (
        True, "JSONDecodeError")
    assert classify_output('{"error": "rate limited"}') == (True, "ToolError", "rate limited")
    assert classify_output('{"error": {"type": "Timeout", "message": "slow"}}') == (
        True, "Timeout", "slow")
    for fine in ("5", '{"error": null, "value": 3}', "no Error here", "Error: x", ""):
        assert classify_output(fine) == (False, None, None), fine
    # A tool message without an id answers the next call of the assistant before it; one
    # that answers nothing is not a fact.
    facts = tool_results([
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "a", "arguments": "not json"}},
            {"function": {"name": "b", "arguments": {"x": 1}}}]},
        {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"},
        {"role": "tool", "content": "3"}, {"role": "tool", "tool_call_id": "zz",
                                          "content": "4"}], episode_id="e", agent="main")
    assert [(f.name, f.arguments, f.output, f.tool_call_id) for f in facts] == [
        ("a", {"raw": "not json"}, "1", None), ("b", {"x": 1}, "2", None)]
    # A client reusing an id in a later turn made a new call: a fact of its own, once.
    turn = [{"role": "assistant", "content": "", "tool_calls": [call("f", "call_0", x=1)]},
            {"role": "tool", "tool_call_id": "call_0", "content": "1"}]
    again = [*turn, {"role": "assistant", "content": "", "tool_calls": [
        call("f", "call_0", x=2)]}, {"role": "tool", "tool_call_id": "call_0", "content": "2"}]
    first, second = tool_results(again, episode_id="e", agent="main")
    assert (first.event_id, first.output) == (
        tool_results(turn, episode_id="e", agent="main")[0].event_id, "1")
    assert (second.tool_call_id, second.arguments, second.output) == ("call_0", {"x": 2}, "2")
    assert second.event_id != first.event_id


def test_tool_results_through_the_gateway_are_facts_analytics_count(
        server: Server, project: Project, api_store: EventStore) -> None:
    ts = TrajstoreClient(server.url, project.ingest)
    episode = ts.episode(f"agent-{uuid.uuid4().hex[:8]}")
    llm = OpenAI(**episode.openai_kwargs)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You solve tasks with tools."},
        {"role": "user", "content": "What is 6 * 7, and what is 1 / 0?"}]
    # Turn 1: the agent calls python twice; one call raises.
    first = llm.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                        max_tokens=8, seed=1)
    calls = [call("python", "c1", code="result = 6 * 7"),
             call("python", "c2", code="result = 1 / 0")]
    messages.append(assistant(first, *calls))
    for c in calls:
        code = json.loads(c["function"]["arguments"])["code"]
        messages.append({"role": "tool", "tool_call_id": c["id"], "content": run_python(code)})
    # Turn 2: a search that fails with a JSON error.
    second = llm.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                         max_tokens=8, seed=2)
    messages.append(assistant(second, call("search", "c3", code="6*7")))
    messages.append({"role": "tool", "tool_call_id": "c3",
                     "content": json.dumps({"error": {"type": "RateLimited",
                                                      "message": "try later"}})})
    # Turn 3: the answer, with the whole history sent again.
    llm.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=8,
                                seed=3)
    episode.finish(reward=1.0)

    recorded = events(api_store, episode.episode_id)
    assert [e.type for e in recorded] == [
        "episode_started", "llm_called", "tool_returned", "tool_returned", "llm_called",
        "tool_returned", "llm_called", "reward_assigned", "episode_finished"]
    tools = [e for e in recorded if isinstance(e, ToolReturned)]
    assert [(t.tool_call_id, t.name, t.arguments["code"], t.is_error, t.error_type)
            for t in tools] == [
        ("c1", "python", "result = 6 * 7", False, None),
        ("c2", "python", "result = 1 / 0", True, "ZeroDivisionError"),
        ("c3", "search", "6*7", True, "RateLimited")]
    assert tools[0].output == "42" and "Traceback" in tools[1].output
    assert tools[1].error_message == "division by zero"

    outcome = project_episode(api_store, episode.episode_id)
    assert outcome.outcome == "written", outcome
    read = project.headers("read")
    detail = httpx.get(f"{server.url}/v1/episodes/{episode.episode_id}", headers=read)
    assert detail.status_code == 200, detail.text
    summary = detail.json()
    summary = summary["summary"]
    assert (summary["tool_calls"], summary["tool_errors"]) == (3, 2)
    rates = httpx.get(f"{server.url}/v1/runs/{episode.run_id}/analytics/tool-errors",
                      headers=read)
    assert rates.status_code == 200, rates.text
    by_tool = {r["tool_name"]: r for r in rates.json()["rows"]}
    assert (by_tool["python"]["calls"], by_tool["python"]["errors"]) == (2, 1)
    assert (by_tool["search"]["calls"], by_tool["search"]["errors"]) == (1, 1)
    failures = httpx.get(f"{server.url}/v1/runs/{episode.run_id}/analytics/failures",
                         headers=read)
    assert failures.status_code == 200, failures.text
    assert {r["error_type"] for r in failures.json()["rows"]} == {
        "ZeroDivisionError", "RateLimited"}


def _samples(server: Server, project: Project, run_id: str) -> list[dict[str, Any]]:
    got = httpx.get(f"{server.url}/v1/runs/{run_id}/samples",
                    params={"tokens": "false"}, headers=project.headers("read"))
    assert got.status_code == 200, got.text
    return list(got.json()["samples"])


@pytest.mark.parametrize("save_negatives", [True, False])
def test_an_abandoned_retry_is_a_negative_sample_not_a_second_positive(
        server: Server, project: Project, api_store: EventStore, tiny_model_dir: Path,
        save_negatives: bool) -> None:
    run_id = f"retry-{uuid.uuid4().hex[:8]}"
    made = httpx.post(f"{server.url}/v1/runs", headers=project.headers("ingest"), json={
        "run_id": run_id, "config": {
            "group_size": 1, "tokenizer": str(tiny_model_dir),
            "rollback": {"save_negative_samples": save_negatives}}})
    assert made.status_code == 201, made.text
    ts = TrajstoreClient(server.url, project.ingest)
    episode = ts.episode(run_id)
    llm = OpenAI(**episode.openai_kwargs)
    prefix = [{"role": "user", "content": "Name a prime number."}]
    # A LangChain-style retry: the same prefix sampled again, the first answer thrown away.
    first = llm.chat.completions.create(model="tiny", messages=prefix, max_tokens=8, seed=11)
    retry = llm.chat.completions.create(model="tiny", messages=prefix, max_tokens=8, seed=12,
                                        extra_headers=episode.abandoning())
    assert retry.id != first.id
    # Naming it again (by id) is idempotent; an unknown call is a 422 naming the header.
    follow = [*prefix, {"role": "assistant", "content": retry.choices[0].message.content},
              {"role": "user", "content": "Another one?"}]
    llm.chat.completions.create(model="tiny", messages=follow, max_tokens=8, seed=13,
                                extra_headers=episode.abandoning(first.id))
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        llm.chat.completions.create(model="tiny", messages=follow, max_tokens=8,
                                    extra_headers={"X-Trajstore-Abandoned": "chatcmpl-nope"})
    assert refused.value.body["field"] == "header.X-Trajstore-Abandoned"  # type: ignore[index]
    episode.finish(reward=1.0)

    recorded = events(api_store, episode.episode_id)
    assert [e.type for e in recorded] == [
        "episode_started", "llm_called", "attempt_failed", "rolled_back", "llm_called",
        "llm_called", "reward_assigned", "episode_finished"]
    failed = next(e for e in recorded if isinstance(e, AttemptFailed))
    assert failed.failed_call_id == first.id and failed.error_types == ["Abandoned"]
    assert next(e for e in recorded if isinstance(e, RolledBack)).discarded_call_ids == [
        first.id]
    calls = [e for e in recorded if isinstance(e, LLMCalled)]
    assert [c.call_id for c in calls] == [first.id, retry.id, calls[2].call_id]

    assert project_episode(api_store, episode.episode_id).outcome == "written"
    samples = _samples(server, project, run_id)
    positives = [s for s in samples if s["kind"] == "positive"]
    negatives = [s for s in samples if s["kind"] == "negative"]
    # The retry is a prefix of the follow-up: one positive, with the full reward.
    assert len(positives) == 1 and positives[0]["reward"] == 1.0
    if save_negatives:
        assert len(negatives) == 1 and negatives[0]["reward"] == -1.0
    else:
        assert negatives == []


def test_abandoning_needs_an_earlier_call(server: Server, project: Project,
                                          api_store: EventStore) -> None:
    ts = TrajstoreClient(server.url, project.ingest)
    episode = ts.episode(f"agent-{uuid.uuid4().hex[:8]}")
    llm = OpenAI(**episode.openai_kwargs)
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        llm.chat.completions.create(model="tiny", max_tokens=4,
                                    messages=[{"role": "user", "content": "hi"}],
                                    extra_headers={"X-Trajstore-Abandoned": "previous"})
    assert refused.value.body["field"] == "header.X-Trajstore-Abandoned"  # type: ignore[index]
    # Nothing was written: neither the run nor the episode exists.
    assert api_store.read_stream(episode.episode_id) == []
