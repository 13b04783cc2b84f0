"""``POST /v1/traces``: OpenTelemetry spans of an instrumented agent stored as an episode.

The real ``opentelemetry-sdk`` and its OTLP/HTTP protobuf exporter send to a running
``trajstore serve``; the JSON encoding, gzip, retries, malformed exports, another project's
episode and OpenInference's attributes go through the app in process. Everything is checked
against the events stored in PostgreSQL."""

from __future__ import annotations

import gzip
import json
import uuid
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Status, StatusCode

from api.otlp.decode import OtlpError, decode_request, media_type
from api.otlp.genai import episode_events
from api.otlp.ingest import default_run
from store import analytics
from store.analytics import Filters
from store.eventlog import EventStore
from tests.api.conftest import Project
from workers.replay.jobs.project import project_episode

QUESTION = "How many files are in the repo?"


def _messages(role: str, *parts: dict[str, Any]) -> str:
    return json.dumps([{"role": role, "parts": list(parts)}])


def agent_spans(episode: str, run: str) -> InMemorySpanExporter:
    """An agent run as the GenAI conventions instrument it: invoke_agent around a chat that
    asks for a tool, the tool failing with a timeout, a second chat answering, and an
    evaluation of the answer; collected in memory to be exported (more than once)."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "solver-agent"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("tests.otlp")
    with tracer.start_as_current_span("invoke_agent solver", attributes={
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "solver",
            "gen_ai.conversation.id": episode, "trajstore.run_id": run}) as root:
        with tracer.start_as_current_span("chat qwen3", attributes={
                "gen_ai.operation.name": "chat", "gen_ai.request.model": "qwen3-0.6b",
                "gen_ai.system_instructions": json.dumps(
                    [{"type": "text", "content": "You are terse."}]),
                "gen_ai.input.messages": _messages("user", {"type": "text",
                                                            "content": QUESTION}),
                "gen_ai.output.messages": json.dumps([{
                    "role": "assistant", "finish_reason": "tool_calls", "parts": [
                        {"type": "tool_call", "id": "call-1", "name": "search",
                         "arguments": {"query": "count files"}}]}]),
                "gen_ai.usage.input_tokens": 31, "gen_ai.usage.output_tokens": 12}):
            pass
        with tracer.start_as_current_span("execute_tool search", attributes={
                "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "search",
                "gen_ai.tool.call.id": "call-1",
                "gen_ai.tool.call.arguments": json.dumps({"query": "count files"}),
                "error.type": "TimeoutError"}) as tool:
            tool.set_status(Status(StatusCode.ERROR, "search timed out after 30 s"))
        with tracer.start_as_current_span("chat qwen3", attributes={
                "gen_ai.operation.name": "chat",
                "gen_ai.input.messages": json.dumps([
                    {"role": "user", "parts": [{"type": "text", "content": QUESTION}]},
                    {"role": "assistant", "parts": [
                        {"type": "tool_call", "id": "call-1", "name": "search",
                         "arguments": {"query": "count files"}}]},
                    {"role": "tool", "parts": [
                        {"type": "tool_call_response", "id": "call-1",
                         "response": "TimeoutError"}]}]),
                "gen_ai.output.messages": json.dumps([{
                    "role": "assistant", "finish_reason": "stop",
                    "parts": [{"type": "text", "content": "I could not count them."}]}])}):
            pass
        root.add_event("gen_ai.evaluation.result", {
            "gen_ai.evaluation.name": "correctness", "gen_ai.evaluation.score.value": 0.25})
    provider.shutdown()
    return memory


def stored(store: EventStore, episode: str) -> list[Any]:
    return store.read_stream(episode)


def test_the_sdk_exporter_records_an_episode_shown_by_the_api_and_the_page(
        start_server: Any, project: Project, api_store: EventStore) -> None:
    server = start_server()
    episode, run = f"conv-{uuid.uuid4().hex[:10]}", f"run-{uuid.uuid4().hex[:8]}"
    spans = agent_spans(episode, run).get_finished_spans()
    exporter = OTLPSpanExporter(endpoint=server.url + "/v1/traces",
                                headers={"Authorization": f"Bearer {project.ingest}"})
    assert exporter.export(spans) == SpanExportResult.SUCCESS

    records = stored(api_store, episode)
    assert [r.type for r in records] == ["episode_started", "llm_called", "tool_returned",
                                         "llm_called", "reward_assigned", "episode_finished"]
    started, first, tool, second, reward, finished = (r.event for r in records)
    assert started.run_id == run and started.group_id == episode
    assert started.messages == [{"role": "system", "content": "You are terse."},
                                {"role": "user", "content": QUESTION}]
    assert first.agent == "solver" and len(first.prompt_ids) == 0
    assert first.response["tool_calls"] == [{
        "type": "function", "id": "call-1",
        "function": {"name": "search", "arguments": '{"query": "count files"}'}}]
    assert first.finish_reason == "tool_calls"
    assert first.usage == {"prompt_tokens": 31, "completion_tokens": 12}
    assert (tool.name, tool.tool_call_id, tool.arguments) == (
        "search", "call-1", {"query": "count files"})
    assert tool.is_error and tool.error_type == "TimeoutError"
    assert tool.error_message == "search timed out after 30 s"
    assert second.messages[-1] == {"role": "tool", "content": "TimeoutError",
                                   "tool_call_id": "call-1"}
    assert second.response["content"] == "I could not count them."
    assert reward.value == 0.25 and reward.components == {"correctness": 0.25}
    assert finished.status == "completed"
    # The run was created on first use, in the key's project.
    runs = httpx.get(f"{server.url}/v1/runs/{run}", headers=project.headers("read"))
    assert runs.status_code == 200, runs.text

    detail = httpx.get(f"{server.url}/v1/episodes/{episode}", headers=project.headers("read"))
    assert detail.status_code == 200, detail.text
    assert [e["type"] for e in detail.json()["events"]][-1] == "episode_finished"

    # Replay stores it (tool failure counted) with no samples, and says why.
    outcome = project_episode(api_store, episode)
    assert outcome.outcome == "written" and outcome.status == "completed"
    assert "captured from OTLP spans without token ids" in (outcome.reason or "")
    failures = analytics.failure_patterns(api_store.db, Filters(run_id=run))
    assert [(f.tool_name, f.error_type, f.failures) for f in failures] == [
        ("search", "TimeoutError", 1)]
    samples = httpx.get(f"{server.url}/v1/runs/{run}/samples",
                        headers=project.headers("read"))
    assert samples.status_code == 200 and samples.json()["samples"] == [], samples.text

    page = httpx.get(f"{server.url}/ui/episodes/{episode}", headers=project.headers("read"))
    assert page.status_code == 200, page.text
    assert "captured from OTLP spans without token ids" in page.text
    assert "search: TimeoutError: search timed out after 30 s" in page.text

    # Sent again (an exporter's retry): stored once.
    assert exporter.export(spans) == SpanExportResult.SUCCESS
    assert len(stored(api_store, episode)) == 6
    exporter.shutdown()


def test_an_openai_client_instrumented_by_openinference(
        start_server: Any, tiny_model_dir: Any, project: Project,
        api_store: EventStore) -> None:
    """The official ``openai`` client, instrumented by OpenInference, calls the gateway's
    engine (plain serving: the gateway records nothing itself); its spans, exported to
    ``/v1/traces``, make the episode."""
    pytest.importorskip("openinference.instrumentation.openai")
    from openai import OpenAI
    from openinference.instrumentation import using_session
    from openinference.instrumentation.openai import OpenAIInstrumentor

    server = start_server(TRAJSTORE_GATEWAY_ENGINE_MODEL=str(tiny_model_dir),
                          TRAJSTORE_GATEWAY_MAX_TOKENS="64")
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    instrumentor = OpenAIInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    session = f"sess-{uuid.uuid4().hex[:10]}"
    messages = [{"role": "system", "content": "You add numbers."},
                {"role": "user", "content": "What is 2 + 3?"}]
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key=project.ingest)
        with using_session(session):
            answer = client.chat.completions.create(model="trajstore", messages=messages,
                                                    max_tokens=8, seed=1)
    finally:
        instrumentor.uninstrument()
    assert stored(api_store, session) == []
    exporter = OTLPSpanExporter(endpoint=server.url + "/v1/traces",
                                headers={"Authorization": f"Bearer {project.ingest}"})
    assert exporter.export(memory.get_finished_spans()) == SpanExportResult.SUCCESS
    exporter.shutdown()
    records = stored(api_store, session)
    assert [r.type for r in records] == ["episode_started", "llm_called"]
    call = records[1].event
    assert call.messages == messages and records[0].event.messages == messages
    assert call.response["content"] == answer.choices[0].message.content
    assert call.usage == {"prompt_tokens": answer.usage.prompt_tokens,
                          "completion_tokens": answer.usage.completion_tokens}
    assert len(call.prompt_ids) == 0  # a client sees no token ids: analysed, not trained


def test_the_documented_example_runs(start_server: Any, project: Project,
                                     api_store: EventStore) -> None:
    """docs/otlp.md's example, as written (a BatchSpanProcessor flushed at shutdown), against
    a running server."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    server = start_server()
    doc = (Path(__file__).resolve().parents[2] / "docs" / "otlp.md").read_text()
    [code] = re.findall(r"```python\n(.*?)```", doc, re.S)
    env = {**os.environ, "API": server.url, "INGEST_KEY": project.ingest}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=env)
    records = stored(api_store, "conv-42")
    assert [r.type for r in records] == ["episode_started", "llm_called", "reward_assigned",
                                         "episode_finished"]
    assert records[0].event.run_id == "support-bot-v3"
    assert records[1].event.agent == "helper"


# --- JSON, gzip, retries ---------------------------------------------------------------------


def _attr(key: str, value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"key": key, "value": {"boolValue": value}}
    if isinstance(value, int):
        return {"key": key, "value": {"intValue": str(value)}}
    if isinstance(value, float):
        return {"key": key, "value": {"doubleValue": value}}
    if isinstance(value, list):
        return {"key": key, "value": {"arrayValue": {"values": [
            _attr("", v)["value"] for v in value]}}}
    return {"key": key, "value": {"stringValue": value}}


def json_span(trace: str, span: str, name: str, start: int, attrs: dict[str, Any], *,
              parent: str = "", end: int | None = None, status: dict[str, Any] | None = None,
              events: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"traceId": trace, "spanId": span, "parentSpanId": parent, "name": name,
            "kind": 1, "startTimeUnixNano": str(start),
            "endTimeUnixNano": str(end or start + 1_000_000),
            "attributes": [_attr(k, v) for k, v in attrs.items()],
            "events": events or [], "status": status or {}}


def export(*spans: dict[str, Any], resource: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"resourceSpans": [{
        "resource": {"attributes": [_attr(k, v) for k, v in (resource or {}).items()]},
        "scopeSpans": [{"scope": {"name": "tests"}, "spans": list(spans)}]}]}


T0 = 1_700_000_000_000_000_000


def json_episode(episode: str, *, trace: str | None = None,
                 tokens: bool = False) -> dict[str, Any]:
    """A chat span (its conversation id on the root only), then a tool span that succeeds,
    exported as OTLP JSON; spans listed out of order (the store sorts them)."""
    trace = trace or uuid.uuid4().hex
    root, chat, tool = (uuid.uuid4().hex[:16] for _ in range(3))
    chat_attrs: dict[str, Any] = {
        "gen_ai.operation.name": "chat",
        "gen_ai.input.messages": _messages("user", {"type": "text", "content": "2+3?"}),
        "gen_ai.output.messages": _messages("assistant", {"type": "text", "content": "5"})}
    if tokens:
        chat_attrs |= {"prompt_token_ids": [1, 2, 3], "response_token_ids": [4, 5],
                       "trajstore.logprobs": [-0.5, -0.25], "trajstore.policy_version": 3}
    return export(
        json_span(trace, tool, "execute_tool calc", T0 + 3_000_000, {
            "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "calc",
            "gen_ai.tool.call.arguments": '{"expr": "2+3"}',
            "gen_ai.tool.call.result": "5"}, parent=root),
        json_span(trace, chat, "chat m", T0 + 1_000_000, chat_attrs, parent=root),
        json_span(trace, root, "invoke_agent a", T0, {
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "calc-agent",
            "gen_ai.conversation.id": episode}, end=T0 + 9_000_000),
        resource={"service.name": "agent"})


def post(client: TestClient, project: Project, body: bytes, *, content_type: str,
         gzipped: bool = False, **headers: str) -> httpx.Response:
    head = {**project.headers("ingest"), "Content-Type": content_type, **headers}
    if gzipped:
        body = gzip.compress(body)
        head["Content-Encoding"] = "gzip"
    return client.post("/v1/traces", content=body, headers=head)


def test_json_encoding_with_gzip(client: TestClient, project: Project,
                                 api_store: EventStore) -> None:
    episode = f"conv-{uuid.uuid4().hex[:10]}"
    body = json.dumps(json_episode(episode, tokens=True)).encode()
    answer = post(client, project, body, content_type="application/json", gzipped=True)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("application/json")
    assert answer.json() == {}
    records = stored(api_store, episode)
    assert [r.type for r in records] == ["episode_started", "llm_called", "tool_returned",
                                         "episode_finished"]
    call = records[1].event
    assert call.agent == "calc-agent" and call.policy_version == 3
    assert call.prompt_ids.tolist() == [1, 2, 3] and call.response_ids.tolist() == [4, 5]
    assert call.logprobs.tolist() == [-0.5, -0.25]
    assert records[2].event.output == "5" and not records[2].event.is_error
    # No run named: the project's default run, created on first use.
    assert records[0].event.run_id == default_run(project.name)


def test_a_batch_sent_twice_is_stored_once(client: TestClient, project: Project,
                                           api_store: EventStore) -> None:
    episode = f"conv-{uuid.uuid4().hex[:10]}"
    body = json.dumps(json_episode(episode)).encode()
    for _ in range(2):
        answer = post(client, project, body, content_type="application/json")
        assert answer.status_code == 200, answer.text
        assert answer.json() == {}
    assert len(stored(api_store, episode)) == 4
    # Spans of an open episode sent again beside a new one: the new one is stored.
    open_episode = f"conv-{uuid.uuid4().hex[:10]}"
    first = json_episode(open_episode)
    spans = first["resourceSpans"][0]["scopeSpans"][0]["spans"]
    del spans[2]  # no agent span: the episode stays open
    for span in spans:
        span["attributes"].append(_attr("gen_ai.conversation.id", open_episode))
    assert post(client, project, json.dumps(first).encode(),
                content_type="application/json").status_code == 200
    spans.append(json_span(spans[0]["traceId"], uuid.uuid4().hex[:16], "execute_tool calc",
                           T0 + 5_000_000, {"gen_ai.operation.name": "execute_tool",
                                            "gen_ai.tool.name": "calc",
                                            "gen_ai.conversation.id": open_episode}))
    answer = post(client, project, json.dumps(first).encode(), content_type="application/json")
    assert answer.status_code == 200 and answer.json() == {}
    assert [r.type for r in stored(api_store, open_episode)] == [
        "episode_started", "llm_called", "tool_returned", "tool_returned"]


def test_the_same_export_sent_concurrently_is_stored_once(
        start_server: Any, project: Project, api_store: EventStore) -> None:
    from concurrent.futures import ThreadPoolExecutor

    server = start_server(TRAJSTORE_OTLP_MAX_CONCURRENT="8")
    episode = f"conv-{uuid.uuid4().hex[:10]}"
    body = gzip.compress(json.dumps(json_episode(episode)).encode())
    head = {**project.headers("ingest"), "Content-Type": "application/json",
            "Content-Encoding": "gzip"}

    def send(_: int) -> httpx.Response:
        return httpx.post(server.url + "/v1/traces", content=body, headers=head, timeout=60)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(send, range(8)))
    assert [a.status_code for a in answers] == [200] * 8, [a.text for a in answers]
    assert [a.json() for a in answers] == [{}] * 8
    assert [r.type for r in stored(api_store, episode)] == [
        "episode_started", "llm_called", "tool_returned", "episode_finished"]


def test_spans_for_a_finished_episode_are_reported_as_rejected(
        client: TestClient, project: Project, api_store: EventStore) -> None:
    episode = f"conv-{uuid.uuid4().hex[:10]}"
    data = json_episode(episode)
    assert post(client, project, json.dumps(data).encode(),
                content_type="application/json").status_code == 200
    # A late chat span of the same conversation, after the agent's span ended it.
    late = json_episode(episode)
    late["resourceSpans"][0]["scopeSpans"][0]["spans"] = \
        late["resourceSpans"][0]["scopeSpans"][0]["spans"][1:2]
    late["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"].append(
        _attr("gen_ai.conversation.id", episode))
    answer = post(client, project, json.dumps(late).encode(), content_type="application/json")
    assert answer.status_code == 200, answer.text
    partial = answer.json()["partialSuccess"]
    assert partial["rejectedSpans"] == "1"
    assert "finished" in partial["errorMessage"]
    assert len(stored(api_store, episode)) == 4


def test_a_models_malformed_tool_arguments_are_kept_as_text(
        client: TestClient, project: Project, api_store: EventStore) -> None:
    episode = f"conv-{uuid.uuid4().hex[:10]}"
    data = json_episode(episode)
    tool = data["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    tool["attributes"][2] = _attr("gen_ai.tool.call.arguments", '{"expr": 2+')
    answer = post(client, project, json.dumps(data).encode(), content_type="application/json")
    assert answer.status_code == 200, answer.text
    ran = next(r.event for r in stored(api_store, episode) if r.type == "tool_returned")
    assert ran.arguments == {"input": '{"expr": 2+'}


def test_protobuf_answer_and_run_header(client: TestClient, project: Project,
                                        api_store: EventStore) -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceResponse,
    )
    from opentelemetry.sdk.trace import TracerProvider as Provider

    memory = InMemorySpanExporter()
    provider = Provider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    episode, run = f"conv-{uuid.uuid4().hex[:10]}", f"hdr-{uuid.uuid4().hex[:8]}"
    with provider.get_tracer("t").start_as_current_span("execute_tool ls", attributes={
            "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "ls",
            "gen_ai.conversation.id": episode}):
        pass
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    body = encode_spans(memory.get_finished_spans()).SerializeToString()
    answer = post(client, project, body, content_type="application/x-protobuf",
                  gzipped=True, **{"X-Trajstore-Run": run})
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/x-protobuf"
    reply = ExportTraceServiceResponse.FromString(answer.content)
    assert not reply.HasField("partial_success")
    records = stored(api_store, episode)
    assert [r.type for r in records] == ["episode_started", "tool_returned"]
    assert records[0].event.run_id == run


# --- bad input -------------------------------------------------------------------------------


def _count_events(store: EventStore) -> int:
    with store.db.connection() as conn:
        return int(conn.execute("SELECT count(*) FROM events").fetchone()[0])


@pytest.mark.parametrize(("content_type", "body", "gzipped", "says"), [
    ("application/x-protobuf", b"\x0a\xff\xff\xff", False, "not an ExportTraceServiceRequest"),
    ("application/json", b'{"resourceSpans": [', False, "not JSON"),
    ("application/json", b'{"resourceSpans": {}}', False, "resourceSpans: must be a list"),
    ("application/json", b"not gzip at all", True, "gzip"),
])
def test_malformed_exports_are_refused_whole(client: TestClient, project: Project,
                                             api_store: EventStore, content_type: str,
                                             body: bytes, gzipped: bool, says: str) -> None:
    before = _count_events(api_store)
    head = {**project.headers("ingest"), "Content-Type": content_type}
    if gzipped:
        head["Content-Encoding"] = "gzip"
    answer = client.post("/v1/traces", content=body, headers=head)
    assert answer.status_code == 400, answer.text
    assert says in answer.json()["error"]["message"]
    assert _count_events(api_store) == before


def test_one_bad_span_refuses_the_whole_export(client: TestClient, project: Project,
                                               api_store: EventStore) -> None:
    before = _count_events(api_store)
    good = json_episode(f"conv-{uuid.uuid4().hex[:10]}")
    spans = good["resourceSpans"][0]["scopeSpans"][0]["spans"]
    # A second episode whose chat span carries token ids without logprobs.
    spans.append(json_span(uuid.uuid4().hex, uuid.uuid4().hex[:16], "chat", T0, {
        "gen_ai.operation.name": "chat", "prompt_token_ids": [1], "response_token_ids": [2]}))
    answer = post(client, project, json.dumps(good).encode(), content_type="application/json")
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert "trajstore.logprobs" in error["message"]
    assert error["field"] == "resourceSpans[0].scopeSpans[0].spans[3]"
    # A trace id of the wrong length.
    bad = json_episode(f"conv-{uuid.uuid4().hex[:10]}", trace="abcd")
    answer = post(client, project, json.dumps(bad).encode(), content_type="application/json")
    assert answer.status_code == 400
    assert answer.json()["error"]["field"].endswith(".traceId")
    # Unparseable GenAI messages.
    broken = json_episode(f"conv-{uuid.uuid4().hex[:10]}")
    chat = broken["resourceSpans"][0]["scopeSpans"][0]["spans"][1]
    chat["attributes"][1] = _attr("gen_ai.input.messages", "[{not json")
    answer = post(client, project, json.dumps(broken).encode(),
                  content_type="application/json")
    assert answer.status_code == 400
    assert "gen_ai.input.messages" in answer.json()["error"]["message"]
    # A conversation id that names a run's stream, or is no id at all.
    for conversation in ("run-abc", "a conversation"):
        answer = post(client, project, json.dumps(json_episode(conversation)).encode(),
                      content_type="application/json")
        assert answer.status_code == 400, answer.text
        assert repr(conversation) in answer.json()["error"]["message"]
    assert _count_events(api_store) == before


def test_unsupported_media_type_and_missing_key(client: TestClient, project: Project) -> None:
    answer = post(client, project, b"x", content_type="text/plain")
    assert answer.status_code == 415
    answer = client.post("/v1/traces", content=b"{}",
                         headers={"Content-Type": "application/json"})
    assert answer.status_code == 401
    answer = client.post("/v1/traces", content=b"{}", headers={
        **project.headers("read"), "Content-Type": "application/json"})
    assert answer.status_code == 403


def test_another_projects_episode_or_run_is_refused(
        client: TestClient, project: Project, other_project: Project,
        api_store: EventStore) -> None:
    episode = f"conv-{uuid.uuid4().hex[:10]}"
    body = json.dumps(json_episode(episode)).encode()
    assert post(client, project, body, content_type="application/json").status_code == 200
    before = _count_events(api_store)
    # The other project's key names the same conversation (new spans), plus one of its own.
    intruder = json_episode(episode)
    intruder["resourceSpans"][0]["scopeSpans"][0]["spans"] += \
        json_episode(f"conv-{uuid.uuid4().hex[:10]}")["resourceSpans"][0]["scopeSpans"][0][
            "spans"]
    answer = post(client, other_project, json.dumps(intruder).encode(),
                  content_type="application/json")
    assert answer.status_code == 403, answer.text
    assert episode in answer.json()["error"]["message"]
    # A run of the first project named by the other's spans.
    run = f"run-{uuid.uuid4().hex[:8]}"
    mine = json_episode(f"conv-{uuid.uuid4().hex[:10]}")
    assert post(client, project, json.dumps(mine).encode(), content_type="application/json",
                **{"X-Trajstore-Run": run}).status_code == 200
    before = _count_events(api_store)
    answer = post(client, other_project,
                  json.dumps(json_episode(f"conv-{uuid.uuid4().hex[:10]}")).encode(),
                  content_type="application/json", **{"X-Trajstore-Run": run})
    assert answer.status_code == 403, answer.text
    assert _count_events(api_store) == before


# --- OpenInference ---------------------------------------------------------------------------


def test_openinference_spans(client: TestClient, project: Project,
                             api_store: EventStore) -> None:
    session, trace = f"sess-{uuid.uuid4().hex[:10]}", uuid.uuid4().hex
    agent, llm, tool = (uuid.uuid4().hex[:16] for _ in range(3))
    body = export(
        json_span(trace, agent, "Agent", T0, {"openinference.span.kind": "AGENT",
                                             "session.id": session, "agent.name": "planner"},
                  end=T0 + 9_000_000, status={"code": "STATUS_CODE_ERROR",
                                              "message": "gave up"}),
        json_span(trace, llm, "ChatCompletion", T0 + 1_000_000, {
            "openinference.span.kind": "LLM", "llm.model_name": "gpt-4o-mini",
            "llm.input_messages.0.message.role": "system",
            "llm.input_messages.0.message.content": "Plan.",
            "llm.input_messages.1.message.role": "user",
            "llm.input_messages.1.message.content": "List the files.",
            "llm.output_messages.0.message.role": "assistant",
            "llm.output_messages.0.message.tool_calls.0.tool_call.id": "t1",
            "llm.output_messages.0.message.tool_calls.0.tool_call.function.name": "ls",
            "llm.output_messages.0.message.tool_calls.0.tool_call.function.arguments":
                '{"path": "."}',
            "llm.token_count.prompt": 9, "llm.token_count.completion": 4}, parent=agent),
        json_span(trace, tool, "ls", T0 + 2_000_000, {
            "openinference.span.kind": "TOOL", "tool.name": "ls",
            "input.value": '{"path": "."}'}, parent=agent,
            status={"code": 2, "message": "permission denied"},
            events=[{"name": "exception", "timeUnixNano": str(T0 + 2_500_000), "attributes": [
                _attr("exception.type", "PermissionError"),
                _attr("exception.message", "permission denied: .")]}]))
    answer = post(client, project, json.dumps(body).encode(), content_type="application/json")
    assert answer.status_code == 200, answer.text
    records = stored(api_store, session)
    assert [r.type for r in records] == ["episode_started", "llm_called", "tool_returned",
                                         "episode_finished"]
    started, call, ran, finished = (r.event for r in records)
    assert started.messages == [{"role": "system", "content": "Plan."},
                                {"role": "user", "content": "List the files."}]
    assert call.agent == "planner"
    assert call.response["tool_calls"] == [{"type": "function", "id": "t1", "function": {
        "name": "ls", "arguments": '{"path": "."}'}}]
    assert call.usage == {"prompt_tokens": 9, "completion_tokens": 4}
    assert (ran.name, ran.arguments, ran.is_error, ran.error_type, ran.error_message) == (
        "ls", {"path": "."}, True, "PermissionError", "permission denied")
    assert (finished.status, finished.reason) == ("error", "gave up")


# --- pure parts ------------------------------------------------------------------------------


def test_decoding_names_the_place_of_a_bad_value() -> None:
    body = export(json_span(uuid.uuid4().hex, uuid.uuid4().hex[:16], "x", T0, {}))
    body["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"] = [
        {"key": "n", "value": {"intValue": "twelve"}}]
    with pytest.raises(OtlpError) as caught:
        decode_request(json.dumps(body).encode(), "application/json")
    assert caught.value.where == \
        "resourceSpans[0].scopeSpans[0].spans[0].attributes[0].value.intValue"
    assert media_type("application/json; charset=utf-8") == "application/json"


def test_episode_ids_follow_the_conversation_then_the_trace() -> None:
    trace = uuid.uuid4().hex
    spans = decode_request(json.dumps(export(
        json_span(trace, "1" * 16, "execute_tool a", T0, {
            "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "a"}),
        json_span(uuid.uuid4().hex, "2" * 16, "execute_tool b", T0, {
            "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "b"}),
        json_span(trace, "3" * 16, "other", T0, {"gen_ai.conversation.id": "c-1"}),
    )).encode(), "application/json")
    plans = episode_events(spans, project="p1")
    assert [p.episode_id for p in plans] == ["c-1", spans[1].trace_id]
    again = episode_events(spans, project="p1")
    assert [e.event_id for e in again[0].events] == [e.event_id for e in plans[0].events]
    elsewhere = episode_events(spans, project="p2")
    assert not {e.event_id for e in elsewhere[0].events} & {e.event_id for e in plans[0].events}


# --- spans with token ids train ----------------------------------------------------------------


def test_spans_with_token_ids_become_training_samples(
        client: TestClient, project: Project, api_store: EventStore) -> None:
    """A chat span with trajstore's token attributes, as an engine-side tracer writes them,
    replays into a sample whose trained tokens are exactly the generated ids."""
    from workers.engines.tokenizers import load_tokenizer

    qwen3 = load_tokenizer("qwen3")
    question = [{"role": "user", "content": "What is 2+3?"}]
    answer = {"role": "assistant", "content": "5"}
    prompt = qwen3.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    full = qwen3.apply_chat_template([*question, answer], tokenize=False)
    prompt_ids = qwen3(prompt, add_special_tokens=False)["input_ids"]
    response_ids = qwen3(full[len(prompt):].rstrip(), add_special_tokens=False)["input_ids"]
    logprobs = [-0.125] * len(response_ids)
    episode, trace = f"conv-{uuid.uuid4().hex[:10]}", uuid.uuid4().hex
    root, chat = uuid.uuid4().hex[:16], uuid.uuid4().hex[:16]
    body = export(
        json_span(trace, root, "invoke_agent", T0, {
            "gen_ai.operation.name": "invoke_agent", "gen_ai.conversation.id": episode},
            end=T0 + 5_000_000,
            events=[{"name": "gen_ai.evaluation.result", "timeUnixNano": str(T0 + 4_000_000),
                     "attributes": [_attr("gen_ai.evaluation.score.value", 1.0)]}]),
        json_span(trace, chat, "chat", T0 + 1_000_000, {
            "gen_ai.operation.name": "chat", "gen_ai.request.model": "Qwen/Qwen3-0.6B",
            "gen_ai.input.messages": _messages("user", {"type": "text",
                                                        "content": "What is 2+3?"}),
            "gen_ai.output.messages": _messages("assistant", {"type": "text",
                                                              "content": "5"}),
            "prompt_token_ids": prompt_ids, "response_token_ids": response_ids,
            "trajstore.logprobs": logprobs}, parent=root))
    reply = post(client, project, json.dumps(body).encode(), content_type="application/json",
                 **{"X-Trajstore-Run": f"trained-{uuid.uuid4().hex[:8]}"})
    assert reply.status_code == 200, reply.text
    outcome = project_episode(api_store, episode)
    assert (outcome.outcome, outcome.status, outcome.reason) == ("written", "completed", None)
    timelines = client.get(f"/v1/episodes/{episode}/timelines",
                           headers=project.headers("read")).json()
    [timeline] = timelines["timelines"]
    assert timeline["token_ids"] == prompt_ids + response_ids
    assert timeline["loss_mask"] == [0] * len(prompt_ids) + [1] * len(response_ids)
    assert timelines["reward"] == 1.0


def test_an_llm_span_that_ended_in_error_is_never_trained(
        client: TestClient, project: Project, api_store: EventStore) -> None:
    """The OTLP door's record of an abandoned call: a chat span whose status is ERROR (the
    client got an error, not the answer) is kept for analysis, but its tokens are trained in
    no sample; the call that replaced it is."""
    from workers.engines.tokenizers import load_tokenizer

    qwen3 = load_tokenizer("qwen3")
    question = [{"role": "user", "content": "What is 2+3?"}]
    prompt = qwen3.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    prompt_ids = qwen3(prompt, add_special_tokens=False)["input_ids"]

    def generated(text: str) -> list[int]:
        full = qwen3.apply_chat_template([*question, {"role": "assistant", "content": text}],
                                         tokenize=False)
        return qwen3(full[len(prompt):].rstrip(), add_special_tokens=False)["input_ids"]

    episode, trace = f"conv-{uuid.uuid4().hex[:10]}", uuid.uuid4().hex
    root, failed, kept = (uuid.uuid4().hex[:16] for _ in range(3))

    def chat(span: str, text: str, start: int, **extra: Any) -> dict[str, Any]:
        ids = generated(text)
        return json_span(trace, span, "chat", start, {
            "gen_ai.operation.name": "chat", "gen_ai.request.model": "Qwen/Qwen3-0.6B",
            "gen_ai.input.messages": _messages("user", {"type": "text",
                                                        "content": "What is 2+3?"}),
            "gen_ai.output.messages": _messages("assistant", {"type": "text",
                                                              "content": text}),
            "prompt_token_ids": prompt_ids, "response_token_ids": ids,
            "trajstore.logprobs": [-0.5] * len(ids)}, parent=root, **extra)

    body = export(
        json_span(trace, root, "invoke_agent", T0, {
            "gen_ai.operation.name": "invoke_agent", "gen_ai.conversation.id": episode,
            "trajstore.reward": 1.0}, end=T0 + 9_000_000),
        chat(failed, "6", T0 + 1_000_000,
             status={"code": 2, "message": "the reply did not validate"}),
        chat(kept, "5", T0 + 3_000_000))
    reply = post(client, project, json.dumps(body).encode(), content_type="application/json",
                 **{"X-Trajstore-Run": f"trained-{uuid.uuid4().hex[:8]}"})
    assert reply.status_code == 200, reply.text
    assert project_episode(api_store, episode).outcome == "written"
    timelines = client.get(f"/v1/episodes/{episode}/timelines",
                           headers=project.headers("read")).json()
    assert timelines["discarded_calls"] == [failed]
    [timeline] = timelines["timelines"]
    assert timeline["token_ids"] == prompt_ids + generated("5")
    assert timeline["loss_mask"] == [0] * len(prompt_ids) + [1] * len(generated("5"))
    assert timelines["negatives"] == []


def _one_call(*spans: dict[str, Any]) -> Any:
    plans = episode_events(decode_request(json.dumps(export(*spans)).encode(),
                                          "application/json"), project="p1")
    [plan] = plans
    [call] = [e for e in plan.events if e.type == "llm_called"]
    return call


def test_the_older_event_convention_and_openllmetry_attributes() -> None:
    trace = uuid.uuid4().hex
    events = [
        {"name": "gen_ai.system.message", "timeUnixNano": str(T0),
         "attributes": [_attr("content", "Be brief.")]},
        {"name": "gen_ai.user.message", "timeUnixNano": str(T0),
         "attributes": [_attr("content", "Weather in Paris?")]},
        {"name": "gen_ai.choice", "timeUnixNano": str(T0), "attributes": [
            _attr("index", 0), _attr("finish_reason", "tool_calls"),
            _attr("message", json.dumps({"role": "assistant", "tool_calls": [
                {"id": "c9", "type": "function", "function": {
                    "name": "weather", "arguments": '{"city": "Paris"}'}}]}))]}]
    call = _one_call(json_span(trace, "a" * 16, "chat gpt", T0, {
        "gen_ai.operation.name": "chat"}, events=events))
    assert call.messages == [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Weather in Paris?"}]
    assert call.response["tool_calls"] == [{"type": "function", "id": "c9", "function": {
        "name": "weather", "arguments": '{"city": "Paris"}'}}]
    assert call.finish_reason == "tool_calls"

    call = _one_call(json_span(trace, "c" * 16, "chat gpt", T0, {
        "gen_ai.operation.name": "chat", "error.type": "RateLimitError"},
        status={"code": 2, "message": "429 Too Many Requests"}))
    assert call.response["error"] == {"type": "RateLimitError",
                                      "message": "429 Too Many Requests"}
    assert call.finish_reason == "error"
    with pytest.raises(OtlpError, match="int32"):
        _one_call(json_span(trace, "d" * 16, "chat", T0, {
            "gen_ai.operation.name": "chat", "prompt_token_ids": [2**40],
            "response_token_ids": [1], "trajstore.logprobs": [-1.0]}))

    call = _one_call(json_span(trace, "b" * 16, "openai.chat", T0, {
        "llm.request.type": "chat",
        "gen_ai.prompt.0.role": "user", "gen_ai.prompt.0.content": "Hi",
        "gen_ai.prompt.1.role": "assistant", "gen_ai.prompt.1.content": "Hello",
        "gen_ai.prompt.10.role": "user", "gen_ai.prompt.10.content": "later",
        "gen_ai.completion.0.role": "assistant", "gen_ai.completion.0.content": "Bye",
        "gen_ai.completion.0.finish_reason": "stop"}))
    assert [m["content"] for m in call.messages] == ["Hi", "Hello", "later"]
    assert (call.response["content"], call.finish_reason) == ("Bye", "stop")
