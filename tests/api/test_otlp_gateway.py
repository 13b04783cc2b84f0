"""An agent seen through two doors: its ``openai`` client instrumented with OpenTelemetry
and calling the capture gateway. The gateway records each call it answers; the client's span
of the same call, exported to ``/v1/traces``, is recognised by the answer's id and not stored
as a second call, whichever arrives first, however often it is sent."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from typing import Any

import httpx
import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from api.access import Access
from api.call_ids import call_event_id
from api.gateway.capture import Capture
from api.gateway.openai_format import Captured
from api.keys import ApiKey
from store.eventlog import EventStore
from store.events import LLMCalled
from tests.api.conftest import Project

pytestmark = pytest.mark.timeout(600)

MESSAGES = [{"role": "system", "content": "You add numbers."},
            {"role": "user", "content": "What is 2 + 3?"}]


def llm_calls(store: EventStore, episode: str) -> list[tuple[uuid.UUID, LLMCalled]]:
    return [(r.event.event_id, r.event) for r in store.read_stream(episode)  # type: ignore
            if isinstance(r.event, LLMCalled)]


def ids(store: EventStore, episode: str) -> list[tuple[uuid.UUID | None, str]]:
    """Each LLM call's event id and call id."""
    return [(event_id, call.call_id) for event_id, call in llm_calls(store, episode)]


def exporter_for(url: str, project: Project) -> OTLPSpanExporter:
    return OTLPSpanExporter(endpoint=url + "/v1/traces",
                            headers={"Authorization": f"Bearer {project.ingest}"})


def test_spans_of_calls_the_gateway_recorded_are_not_stored_again(
        start_server: Any, tiny_model_dir: Any, project: Project,
        api_store: EventStore) -> None:
    """Gateway first (the order a live agent produces: the gateway records before it
    answers, the span ends after the answer): the official ``openai`` client, instrumented
    by OpenInference, through the gateway's episode path, streamed and not."""
    pytest.importorskip("openinference.instrumentation.openai")
    from openai import OpenAI
    from openinference.instrumentation import using_session
    from openinference.instrumentation.openai import OpenAIInstrumentor

    server = start_server(TRAJSTORE_GATEWAY_ENGINE_MODEL=str(tiny_model_dir),
                          TRAJSTORE_GATEWAY_MAX_TOKENS="16")
    run, episode = f"run-{uuid.uuid4().hex[:8]}", f"ep-{uuid.uuid4().hex[:10]}"
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    instrumentor = OpenAIInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    try:
        client = OpenAI(base_url=f"{server.url}/v1/runs/{run}/episodes/{episode}",
                        api_key=project.ingest)
        with using_session(episode):
            answer = client.chat.completions.create(model="trajstore", messages=MESSAGES,
                                                    max_tokens=8, seed=1)
            chunks = list(client.chat.completions.create(
                model="trajstore", messages=MESSAGES, max_tokens=8, seed=2, stream=True))
    finally:
        instrumentor.uninstrument()
    answer_ids = [answer.id, chunks[0].id]
    recorded = llm_calls(api_store, episode)
    assert [call.call_id for _, call in recorded] == answer_ids
    assert [event_id for event_id, _ in recorded] == [call_event_id(i) for i in answer_ids]
    spans = memory.get_finished_spans()
    assert len(spans) == 2

    exporter = exporter_for(server.url, project)
    for _ in range(2):  # and an exporter's retry
        assert exporter.export(spans) == SpanExportResult.SUCCESS
        assert ids(api_store, episode) == [(e, c.call_id) for e, c in recorded]
    exporter.shutdown()
    # The gateway's records, with their token ids, are the ones kept.
    assert all(len(call.response_ids) > 0 for _, call in recorded)
    assert [r.type for r in api_store.read_stream(episode)] == [
        "episode_started", "llm_called", "llm_called"]


def test_a_span_stored_first_makes_the_gateway_record_nothing_twice(
        start_server: Any, project: Project, api_store: EventStore) -> None:
    """Span first: a GenAI-convention span carrying ``gen_ai.response.id``, exported with
    the SDK's exporter, then the gateway's record of the call answered with that id."""
    server = start_server()
    run, episode = f"run-{uuid.uuid4().hex[:8]}", f"ep-{uuid.uuid4().hex[:10]}"
    answer_id = f"chatcmpl-{uuid.uuid4().hex}"
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    with provider.get_tracer("agent").start_as_current_span("chat trajstore", attributes={
            "gen_ai.operation.name": "chat", "gen_ai.conversation.id": episode,
            "trajstore.run_id": run, "gen_ai.response.id": answer_id,
            "gen_ai.input.messages": json.dumps(
                [{"role": m["role"], "parts": [{"type": "text", "content": m["content"]}]}
                 for m in MESSAGES]),
            "gen_ai.output.messages": json.dumps([{
                "role": "assistant", "finish_reason": "stop",
                "parts": [{"type": "text", "content": "5"}]}])}):
        pass
    exporter = exporter_for(server.url, project)
    assert exporter.export(memory.get_finished_spans()) == SpanExportResult.SUCCESS
    first = llm_calls(api_store, episode)
    assert [event_id for event_id, _ in first] == [call_event_id(answer_id)]
    assert first[0][1].response["otlp"]["response_id"] == answer_id

    key = ApiKey(key_id="k", project=project.name, role="ingest", name=None,
                 created_at=dt.datetime.now(dt.UTC))
    capture = Capture(api_store, Access(api_store))
    target = capture.target(key, episode)

    def record(call_id: str, content: str) -> Any:
        return capture.record(target, Captured(
            prompt_ids=[1, 2, 3], response_ids=[4, 5], logprobs=[-0.5, -0.25],
            message={"role": "assistant", "content": content}, finish_reason="stop"),
            agent="main", call_id=call_id, messages=MESSAGES, tools=None, latency_ms=3.0)

    result = record(answer_id, "5")
    assert result.duplicate and result.positions == ()
    assert ids(api_store, episode) == [(e, c.call_id) for e, c in first]
    # The span sent again changes nothing either.
    assert exporter.export(memory.get_finished_spans()) == SpanExportResult.SUCCESS
    assert ids(api_store, episode) == [(e, c.call_id) for e, c in first]
    exporter.shutdown()

    # Another answer is recorded; an upstream that reuses an answer id does not lose calls.
    other = f"chatcmpl-{uuid.uuid4().hex}"
    assert not record(other, "five").duplicate
    assert not record(other, "5 again").duplicate
    calls = llm_calls(api_store, episode)
    assert [call.call_id for _, call in calls] == [first[0][1].call_id, other, other]
    assert calls[1][0] == call_event_id(other) and calls[2][0] != call_event_id(other)
    detail = httpx.get(f"{server.url}/v1/episodes/{episode}", headers=project.headers("read"))
    assert [e["type"] for e in detail.json()["events"]].count("llm_called") == 3
