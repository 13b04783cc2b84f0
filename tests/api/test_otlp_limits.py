"""``POST /v1/traces`` under budgets: what one export may hold is bounded (spans, attribute
values, nesting, keys, decompressed size), malformed bodies are refused with a 4xx naming the
place (never a 500), and span ids are scoped by project (another project's export of the
same ids stores its own events and leaves the first project's alone).

Everything goes through the real app and PostgreSQL; the neighbour test through a running
``trajstore serve``."""

from __future__ import annotations

import gzip
import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from api.app import create_app
from store.eventlog import EventStore
from store.settings import Settings
from tests.api.conftest import Project
from tests.api.test_otlp import T0, _attr, export, json_episode, json_span, post

JSON = "application/json"
PROTOBUF = "application/x-protobuf"


@pytest.fixture
def small(api_settings: Settings, api_store: EventStore) -> Iterator[TestClient]:
    """The app with small OTLP limits."""
    settings = api_settings.model_copy(update={
        "otlp_max_spans": 5, "otlp_max_attributes": 20, "otlp_max_depth": 4,
        "otlp_max_key_chars": 64, "otlp_max_bytes": 64 * 1024})
    with TestClient(create_app(settings, store=api_store)) as c:
        yield c


def _spans(n: int, **attrs: Any) -> dict[str, Any]:
    trace = uuid.uuid4().hex
    return export(*(json_span(trace, uuid.uuid4().hex[:16], "chat", T0, attrs)
                    for _ in range(n)))


def _refused(answer: httpx.Response, status: int, setting: str) -> dict[str, Any]:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert f"TRAJSTORE_{setting}" in error["message"], error
    return dict(error)


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {"stringValue": "x"}
    for _ in range(depth):
        value = {"kvlistValue": {"values": [{"key": "k", "value": value}]}}
    return value


def test_exports_over_a_limit_are_413_naming_the_limit_and_setting(
        small: TestClient, project: Project, api_store: EventStore) -> None:
    body = json.dumps(_spans(6)).encode()
    error = _refused(post(small, project, body, content_type=JSON), 413, "OTLP_MAX_SPANS")
    assert "(6)" in error["message"] and "limit of 5" in error["message"]

    many = _spans(1, **{f"a{i}": i for i in range(21)})
    error = _refused(post(small, project, json.dumps(many).encode(), content_type=JSON),
                     413, "OTLP_MAX_ATTRIBUTES")
    assert error["field"] == "resourceSpans[0].scopeSpans[0].spans[0]"
    # Array elements count too.
    wide = _spans(1, a=list(range(30)))
    _refused(post(small, project, json.dumps(wide).encode(), content_type=JSON), 413,
             "OTLP_MAX_ATTRIBUTES")

    deep = _spans(1)
    deep["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"] = [
        {"key": "d", "value": _nested(5)}]
    _refused(post(small, project, json.dumps(deep).encode(), content_type=JSON), 413,
             "OTLP_MAX_DEPTH")

    long_key = _spans(1, **{"k" * 65: "v"})
    error = _refused(post(small, project, json.dumps(long_key).encode(), content_type=JSON),
                     413, "OTLP_MAX_KEY_CHARS")
    assert error["field"].endswith("attributes[0].key")

    # A gzip body small on the wire, over the limit once decompressed.
    bomb = json.dumps(_spans(1, pad="x" * 200_000)).encode()
    _refused(post(small, project, bomb, content_type=JSON, gzipped=True), 413,
             "OTLP_MAX_BYTES")
    _refused(post(small, project, bomb, content_type=JSON), 413, "OTLP_MAX_BYTES")

    # The same limits bind protobuf.
    request = ExportTraceServiceRequest()
    spans = request.resource_spans.add().scope_spans.add()
    for i in range(6):
        span = spans.spans.add(trace_id=b"\x01" * 16, span_id=bytes([i + 1]) * 8, name="s")
    _refused(post(small, project, request.SerializeToString(), content_type=PROTOBUF), 413,
             "OTLP_MAX_SPANS")
    del spans.spans[1:]
    span = spans.spans[0]
    value = span.attributes.add(key="d").value
    for _ in range(6):
        value = value.kvlist_value.values.add(key="k").value
    value.string_value = "x"
    _refused(post(small, project, request.SerializeToString(), content_type=PROTOBUF), 413,
             "OTLP_MAX_DEPTH")
    # Nothing was stored by any of them: a valid export within the limits still is.
    episode = f"conv-{uuid.uuid4().hex[:10]}"
    answer = post(small, project, json.dumps(json_episode(episode)).encode(),
                  content_type=JSON)
    assert answer.status_code == 200, answer.text
    assert len(api_store.read_stream(episode)) == 4


def _with_time(value: Any) -> bytes:
    body = _spans(1)
    body["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["startTimeUnixNano"] = value
    return json.dumps(body).encode()


def _with_int(value: Any) -> bytes:
    body = _spans(1)
    body["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"] = [
        {"key": "n", "value": {"intValue": value}}]
    return json.dumps(body).encode()


@pytest.mark.parametrize(("body", "status", "says"), [
    (b"[" * 100_000 + b"]" * 100_000, 400, "nested too deeply"),
    (b'{"a":' * 3000 + b"1" + b"}" * 3000, 400, ""),
    (b"", 400, "not JSON"),
    (_with_time("9" * 400), 400, "must be an integer"),
    (_with_time(int("9" * 400)), 400, "must be an integer from 0"),
    (_with_time("١٧٠٠٠٠٠٠٠٠٠٠٠٠٠٠٠٠٠٠"), 400, "ASCII decimal digits"),
    (_with_time("1_700_000"), 400, "ASCII decimal digits"),
    (_with_time(" 17"), 400, "ASCII decimal digits"),
    (_with_time(-5), 400, "must be an integer from 0"),
    (_with_int("9" * 400), 400, "must be an integer"),
    (_with_int("٣"), 400, "ASCII decimal digits"),
    (_with_int(2**63), 400, "must be an integer from"),
], ids=["deep-json", "3000-level-keys", "empty", "400-digit-time-text",
        "400-digit-time-number", "arabic-digits", "underscores", "space", "negative-time",
        "400-digit-int", "arabic-int", "int-past-64-bits"])
def test_malformed_bodies_are_4xx_never_500(client: TestClient, project: Project,
                                            body: bytes, status: int, says: str) -> None:
    answer = post(client, project, body, content_type=JSON)
    assert answer.status_code == status, answer.text
    assert says in answer.json()["error"]["message"]


def test_a_3000_level_attribute_value_is_refused(client: TestClient,
                                                  project: Project) -> None:
    def body(levels: int) -> bytes:
        text = json.dumps(_spans(1))
        value = ('{"kvlistValue": {"values": [{"key": "k", "value": ' * levels
                 + '{"stringValue": "x"}' + "}]}}" * levels)
        return text.replace('"attributes": []', f'"attributes": [{{"key": "d", "value": '
                                                f'{value}}}]', 1).encode()

    _refused(post(client, project, body(100), content_type=JSON), 413, "OTLP_MAX_DEPTH")
    # Deeper than the JSON parser goes: a 400 naming why, not a 500.
    answer = post(client, project, body(3000), content_type=JSON)
    assert answer.status_code == 400, answer.text
    assert "nested too deeply" in answer.json()["error"]["message"]


def test_protobuf_nested_past_the_parser_is_400(client: TestClient, project: Project) -> None:
    value = AnyValue(string_value="x")
    raw = value.SerializeToString()
    for _ in range(3000):
        # AnyValue.kvlist_value (field 6) holding one KeyValue (field 1) whose value is
        # field 2: written by hand, as the library refuses to build it.
        kv = b"\x0a\x01k" + b"\x12" + _varint(len(raw)) + raw
        kvlist = b"\x0a" + _varint(len(kv)) + kv
        raw = b"\x32" + _varint(len(kvlist)) + kvlist
    attr = b"\x0a\x01d\x12" + _varint(len(raw)) + raw
    span = (b"\x0a\x10" + b"\x01" * 16 + b"\x12\x08" + b"\x02" * 8
            + b"\x4a" + _varint(len(attr)) + attr)
    scope = b"\x12" + _varint(len(span)) + span
    resource = b"\x12" + _varint(len(scope)) + scope
    body = b"\x0a" + _varint(len(resource)) + resource
    answer = post(client, project, body, content_type=PROTOBUF)
    assert answer.status_code in (400, 413), answer.text


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


# --- span ids scoped by project -------------------------------------------------------------


def test_another_projects_identical_span_ids_are_stored_for_it(
        client: TestClient, project: Project, other_project: Project,
        api_store: EventStore) -> None:
    """A span id known in advance drops nothing: the second project's spans of the same
    trace and span ids (and the same answer id) are its own events, stored, and the first
    project's episode is left as it was."""
    trace = uuid.uuid4().hex
    mine, theirs = (f"conv-{uuid.uuid4().hex[:10]}" for _ in range(2))
    answer_id = f"chatcmpl-{uuid.uuid4().hex}"

    def body(episode: str) -> bytes:
        data = json_episode(episode, trace=trace)
        spans = data["resourceSpans"][0]["scopeSpans"][0]["spans"]
        for span in spans:
            span["spanId"] = {"execute_tool calc": "1" * 16, "chat m": "2" * 16,
                              "invoke_agent a": "3" * 16}[span["name"]]
            span["parentSpanId"] = "" if span["name"] == "invoke_agent a" else "3" * 16
        spans[1]["attributes"].append(_attr("gen_ai.response.id", answer_id))
        return json.dumps(data).encode()

    # The other project sends first, in advance.
    first = post(client, other_project, body(theirs), content_type=JSON)
    assert first.status_code == 200 and first.json() == {}, first.text
    second = post(client, project, body(mine), content_type=JSON)
    assert second.status_code == 200 and second.json() == {}, second.text
    ours = api_store.read_stream(mine)
    assert [r.type for r in ours] == ["episode_started", "llm_called", "tool_returned",
                                      "episode_finished"]
    other = api_store.read_stream(theirs)
    assert len(other) == 4
    assert not {r.event.event_id for r in ours} & {r.event.event_id for r in other}
    # Each project's retry is still stored once.
    for p, episode, records in ((project, mine, ours), (other_project, theirs, other)):
        again = post(client, p, body(episode), content_type=JSON)
        assert again.status_code == 200 and again.json() == {}, again.text
        assert len(api_store.read_stream(episode)) == len(records)


# --- the neighbour is not slowed --------------------------------------------------------------


def test_a_neighbours_export_is_not_held_up_by_refused_floods(
        start_server: Any, project: Project, other_project: Project,
        api_store: EventStore) -> None:
    """One project floods large exports over the span limit from three connections (each
    decoded in a child process, one at a time for the project, the others answered 429);
    another project's ordinary export meanwhile answers about as quickly as it does alone
    (within 2x plus slack for a shared machine)."""
    server = start_server(TRAJSTORE_OTLP_MAX_SPANS="200",
                          TRAJSTORE_API_MAX_REQUEST_BYTES=str(64 * 1024 * 1024))
    flood = gzip.compress(json.dumps(_spans(20_000, **{
        f"gen_ai.k{i}": "v" * 20 for i in range(8)})).encode())
    headers = {**project.headers("ingest"), "Content-Type": JSON, "Content-Encoding": "gzip"}

    def victim() -> float:
        episode = f"conv-{uuid.uuid4().hex[:10]}"
        started = time.perf_counter()
        answer = httpx.post(server.url + "/v1/traces",
                            content=json.dumps(json_episode(episode)).encode(),
                            headers={**other_project.headers("ingest"), "Content-Type": JSON},
                            timeout=60)
        took = time.perf_counter() - started
        assert answer.status_code == 200, answer.text
        assert len(api_store.read_stream(episode)) == 4
        return took

    quiet = sorted(victim() for _ in range(5))[2]
    refusals: list[int] = []
    stop = threading.Event()

    def attack() -> None:
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                answer = c.post(server.url + "/v1/traces", content=flood, headers=headers)
                refusals.append(answer.status_code)

    threads = [threading.Thread(target=attack) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)
        loaded = sorted(victim() for _ in range(5))[2]
    finally:
        stop.set()
        for t in threads:
            t.join()
    # Refused for its size, or for having an export in progress already (429).
    assert 413 in refusals and set(refusals) <= {413, 429}, refusals
    print(f"victim's median export: quiet {quiet:.3f} s, under the flood {loaded:.3f} s")
    assert loaded <= 2 * quiet + 1.0, (quiet, loaded)
