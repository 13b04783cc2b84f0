"""Values the store refuses on every way in (REST events, runs, episodes, the Python API),
each with a 422 naming the field: NUL and lone surrogates in any string, nesting deeper than
64 levels, non-finite numbers (logprobs included, as JSON and as float32 base64), integers
past 64 bits, booleans where numbers go (rows stored with NUL before: test_nul_rows.py)."""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from store import errors
from store.eventlog import EventStore
from store.events import RunCreated, ToolReturned
from tests.api.conftest import Project
from tests.api.test_ingest import create_run, llm_event, start_episode


def post_raw(client: TestClient, url: str, text: str, project: Project) -> Any:
    """POST ``text`` as the JSON body, byte for byte (for escapes a JSON encoder would not
    write, such as a lone surrogate, -Infinity or 1e400)."""
    return client.post(url, content=text.encode(), headers={
        **project.headers("ingest"), "Content-Type": "application/json"})


def assert_422(response: Any, *needles: str) -> dict[str, Any]:
    assert response.status_code == 422, (response.status_code, response.text[:500])
    body = response.json()
    message = body["error"]["message"]
    for needle in needles:
        assert needle in message or needle in json.dumps(body), (needle, body)
    return body


def events_url(episode_id: str) -> str:
    return f"/v1/episodes/{episode_id}/events"


def test_nul_in_a_run_config_is_refused_naming_the_field(client: TestClient,
                                                         project: Project) -> None:
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    r = client.post("/v1/runs", json={"run_id": run_id,
                                      "config": {"chat_template": "{{ x }}\u0000"}},
                    headers=project.headers("ingest"))
    assert_422(r, "config.chat_template", "NUL")
    assert client.get(f"/v1/runs/{run_id}", headers=project.headers("read")).status_code == 404
    assert client.get("/v1/runs", headers=project.headers("read")).status_code == 200


@pytest.mark.parametrize(("field", "event"), [
    ("output", {"type": "tool_returned", "name": "t", "output": "a\u0000b"}),
    ("error_message", {"type": "tool_returned", "name": "t", "error_message": "\u0000"}),
    ("arguments.k[1]", {"type": "tool_returned", "name": "t", "arguments": {"k": ["", "\u0000"]}}),
    ("error_messages[0]", {"type": "attempt_failed", "checkpoint_id": "c",
                           "position_key": "turn_1", "retry_index": 0,
                           "error_messages": ["x\u0000"]}),
])
def test_nul_anywhere_in_an_event_is_refused(client: TestClient, project: Project, field: str,
                                             event: dict[str, Any]) -> None:
    episode = start_episode(client, project, create_run(client, project))
    r = client.post(events_url(episode), json={"expected_version": 1, "events": [event]},
                    headers=project.headers("ingest"))
    assert_422(r, field, "NUL")
    detail = client.get(f"/v1/episodes/{episode}", headers=project.headers("read"))
    assert detail.status_code == 200 and len(detail.json()["events"]) == 1


def test_nul_in_an_episode_start_is_refused(client: TestClient, project: Project) -> None:
    run_id = create_run(client, project)
    r = client.post(f"/v1/runs/{run_id}/episodes",
                    json={"group_id": "g0", "task_id": "t\u0000"},
                    headers=project.headers("ingest"))
    assert_422(r, "task_id")
    r = client.post(f"/v1/runs/{run_id}/episodes",
                    json={"group_id": "g0", "messages": [{"role": "user", "co\u0000": "x"}]},
                    headers=project.headers("ingest"))
    assert_422(r, "messages[0]", "object key")


def test_a_lone_surrogate_is_refused_with_422_not_500(client: TestClient,
                                                      project: Project) -> None:
    episode = start_episode(client, project, create_run(client, project))
    text = ('{"expected_version": 1, "events": [{"type": "tool_returned", "name": "t",'
            ' "output": "ok \\ud800 then"}]}')
    assert_422(post_raw(client, events_url(episode), text, project), "output", "surrogate")
    run_text = '{"run_id": "r-' + uuid.uuid4().hex[:8] + '", "config": {"model": "\\udfff"}}'
    assert_422(post_raw(client, "/v1/runs", run_text, project), "config.model", "surrogate")


def test_the_python_api_refuses_the_same(api_store: EventStore) -> None:
    with pytest.raises(errors.ValidationError) as info:
        api_store.append(f"run-{uuid.uuid4().hex}", [RunCreated(
            run_id="r", config={"chat_template": "\u0000"})], "no_stream")
    assert info.value.field == "config.chat_template"
    with pytest.raises(errors.ValidationError) as info:
        api_store.append(f"ep-{uuid.uuid4().hex}", [ToolReturned(name="t", output="\ud800")])
    assert info.value.field == "output"
    with pytest.raises(errors.ValidationError) as info:
        api_store.append("ep-\ud800", [ToolReturned(name="t")])
    assert info.value.field == "stream_id"


def nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = {"a": value}
    return value


def test_deep_nesting_is_refused_and_the_limit_itself_is_stored(client: TestClient,
                                                                project: Project) -> None:
    episode = start_episode(client, project, create_run(client, project))
    rng = np.random.default_rng(0)
    deep = llm_event(rng)
    deep["response"] = nested(300)
    r = client.post(events_url(episode), json={"expected_version": 1, "events": [deep]},
                    headers=project.headers("ingest"))
    assert_422(r, "response.a.a", "nested deeper than 64")
    tool = {"type": "tool_returned", "name": "t", "arguments": nested(70)}
    assert_422(client.post(events_url(episode), json={"expected_version": 1, "events": [tool]},
                           headers=project.headers("ingest")), "arguments.a")
    ok = {"type": "tool_returned", "name": "t", "arguments": nested(63)}
    r = client.post(events_url(episode), json={"expected_version": 1, "events": [ok]},
                    headers=project.headers("ingest"))
    assert r.status_code == 200, r.text
    detail = client.get(f"/v1/episodes/{episode}", headers=project.headers("read"))
    assert detail.status_code == 200
    assert detail.json()["events"][1]["data"]["arguments"] == nested(63)


def test_a_body_nested_past_the_json_parser_is_a_4xx(client: TestClient,
                                                     project: Project) -> None:
    episode = start_episode(client, project, create_run(client, project))
    text = '{"expected_version": 1, "events": [' + "[" * 5000 + "]" * 5000 + "]}"
    r = post_raw(client, events_url(episode), text, project)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])


@pytest.mark.parametrize("logprob", ["-Infinity", "-1e400", "NaN", "-1e39"])
def test_non_finite_logprobs_are_refused(client: TestClient, project: Project,
                                         logprob: str) -> None:
    episode = start_episode(client, project, create_run(client, project))
    event = llm_event(np.random.default_rng(1), n_response=3)
    event["logprobs"] = ["LP", -0.5, -0.25]
    text = json.dumps({"expected_version": 1, "events": [event]}).replace('"LP"', logprob)
    assert_422(post_raw(client, events_url(episode), text, project), "logprobs")


def test_float32_infinity_in_base64_logprobs_is_refused(client: TestClient,
                                                        project: Project) -> None:
    episode = start_episode(client, project, create_run(client, project))
    event = llm_event(np.random.default_rng(2), n_response=3, base64_tokens=True)
    event["logprobs"] = base64.b64encode(
        np.array([-0.5, -np.inf, -0.1], dtype="<f4").tobytes()).decode()
    r = client.post(events_url(episode), json={"expected_version": 1, "events": [event]},
                    headers=project.headers("ingest"))
    assert_422(r, "logprobs", "finite")


@pytest.mark.parametrize(("field", "value"), [
    ("duration_ms", "Infinity"), ("duration_ms", "1e400"), ("arguments.x", "NaN"),
    ("arguments.x", "-Infinity"),
])
def test_non_finite_numbers_elsewhere_are_refused(client: TestClient, project: Project,
                                                  field: str, value: str) -> None:
    episode = start_episode(client, project, create_run(client, project))
    name = field.split(".")[0]
    payload = '"V"' if name == "duration_ms" else '{"x": "V"}'
    text = ('{"expected_version": 1, "events": [{"type": "tool_returned", "name": "t", "'
            + name + '": ' + payload + "}]}").replace('"V"', value)
    assert_422(post_raw(client, events_url(episode), text, project), field)


def test_integers_past_64_bits_are_refused(client: TestClient, project: Project) -> None:
    episode = start_episode(client, project, create_run(client, project))
    event = {"type": "tool_returned", "name": "t", "arguments": {"n": 2**64}}
    r = client.post(events_url(episode), json={"expected_version": 1, "events": [event]},
                    headers=project.headers("ingest"))
    assert_422(r, "arguments.n", "64 bits")
    event = {"type": "tool_returned", "name": "t", "arguments": {"n": -(2**63) + 1}}
    r = client.post(events_url(episode), json={"expected_version": 1, "events": [event]},
                    headers=project.headers("ingest"))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("expected", [True, False, 2**40, 2**70])
def test_expected_version_must_be_a_real_version(client: TestClient, project: Project,
                                                 expected: object) -> None:
    episode = start_episode(client, project, create_run(client, project))
    r = client.post(events_url(episode), json={"expected_version": expected, "events": [
        {"type": "tool_returned", "name": "t"}]}, headers=project.headers("ingest"))
    assert_422(r, "expected_version")
    detail = client.get(f"/v1/episodes/{episode}", headers=project.headers("read"))
    assert len(detail.json()["events"]) == 1


@pytest.mark.parametrize(("field", "event"), [
    ("value", {"type": "reward_assigned", "value": True}),
    ("components", {"type": "reward_assigned", "value": 1.0, "components": {"a": False}}),
    ("retry_index", {"type": "checkpoint_created", "checkpoint_id": "c",
                     "position_key": "turn_1", "retry_count": True}),
])
def test_booleans_are_not_numbers(client: TestClient, project: Project, field: str,
                                  event: dict[str, Any]) -> None:
    episode = start_episode(client, project, create_run(client, project))
    r = client.post(events_url(episode), json={"expected_version": 1, "events": [event]},
                    headers=project.headers("ingest"))
    assert_422(r, field.replace("retry_index", "retry_count"), "boolean")
    r = client.post(f"/v1/runs/{create_run(client, project)}/episodes",
                    json={"group_id": "g", "policy_version": True},
                    headers=project.headers("ingest"))
    assert_422(r, "policy_version")


def test_a_lease_whose_answer_cannot_be_built_leaves_nothing_leased(
        api_settings: Any, api_store: EventStore, project: Project) -> None:
    """A JSON lease answer that cannot be written (a non-finite logprob that an older store
    let into a sample) must not leave the samples leased until expiry."""
    from api.app import create_app
    from tests.api.episodes import create_run as store_run
    from tests.api.episodes import record_group
    from workers.engines.tokenizers import load_tokenizer

    run_id = f"run-{uuid.uuid4().hex[:8]}"
    store_run(api_store, run_id, project=project.name, group_size=2)
    record_group(api_store, load_tokenizer("qwen3"), run_id=run_id, group_id="g0")
    with api_store.db.transaction() as conn:
        sample_id, logprobs = conn.execute(
            "SELECT sample_id, logprobs FROM samples WHERE run_id = %s ORDER BY sample_id"
            " LIMIT 1", (run_id,)).fetchone()
        bad = np.frombuffer(bytes(logprobs), dtype="<f4").copy()
        bad[-1] = -np.inf
        conn.execute("UPDATE samples SET logprobs = %s WHERE sample_id = %s",
                     (bad.astype("<f4").tobytes(), sample_id))
    headers = project.headers("train")
    with TestClient(create_app(api_settings, store=api_store),
                    raise_server_exceptions=False) as c:
        failed = c.post(f"/v1/runs/{run_id}/leases", json={"groups": 1}, headers=headers)
        assert failed.status_code >= 400
        with api_store.db.connection() as conn:
            statuses = {s for (s,) in conn.execute(
                "SELECT status FROM samples WHERE run_id = %s", (run_id,)).fetchall()}
            leases = conn.execute("SELECT count(*) FROM leases WHERE run_id = %s",
                                  (run_id,)).fetchone()[0]
        assert statuses == {"ready"} and leases == 0
        # Parquet holds the value: the same group leases at once, no expiry to wait for.
        ok = c.post(f"/v1/runs/{run_id}/leases", json={"groups": 1, "format": "parquet"},
                    headers=headers)
        assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(("params", "field"), [
    ({"min_version": 2**31}, "min_version"), ({"max_version": 2**40}, "max_version"),
    ({"since": "9999999d"}, "since"), ({"until": "99999999999999999999d"}, "until"),
    ({"tool": "a\u0000"}, "tool"),
])
@pytest.mark.parametrize("view", ["failures", "outcomes", "signatures"])
def test_analytics_filters_out_of_range_are_4xx(client: TestClient, project: Project,
                                                view: str, params: dict[str, Any],
                                                field: str) -> None:
    if field == "tool" and view == "outcomes":
        pytest.skip("outcomes takes no tool filter")
    run_id = create_run(client, project)
    r = client.get(f"/v1/runs/{run_id}/analytics/{view}", params=params,
                   headers=project.headers("read"))
    assert_422(r, field)


@pytest.mark.parametrize("path", [
    "/v1/runs/{run}/samples/export.parquet?group_id=g%00",
    "/v1/runs/{run}/samples?group_id=%00",
    "/v1/episodes?run_id={run}&tool_name=x%00",
    "/v1/runs/{run}%00",
])
def test_nul_in_a_url_is_422_before_any_stream_starts(client: TestClient, project: Project,
                                                      path: str) -> None:
    run_id = create_run(client, project)
    r = client.get(path.format(run=run_id), headers=project.headers("read"))
    assert r.status_code == 422, (r.status_code, r.text[:300])
    assert r.json()["error"]["field"] in ("group_id", "tool_name", "path")
    assert r.headers["content-type"].startswith("application/json")


def test_the_gateway_and_remote_rollout_refuse_before_generating(
        client: TestClient, project: Project) -> None:
    run_id = create_run(client, project)
    episode = start_episode(client, project, run_id)
    headers = {**project.headers("ingest"), "X-Trajstore-Episode": episode}
    r = client.post("/v1/chat/completions", headers=headers, json={
        "model": "m", "messages": [{"role": "user", "content": "hi\u0000"}]})
    assert_422(r, "messages[0].content", "NUL")
    text = ('{"model": "m", "messages": [{"role": "user", "content": "\\udc00"}]}')
    r = client.post("/v1/chat/completions", content=text.encode(),
                    headers={**headers, "Content-Type": "application/json"})
    assert_422(r, "messages[0].content", "surrogate")
    r = client.post("/v1/completions", headers=headers, json={"model": "m", "prompt": "\u0000"})
    assert_422(r, "prompt")
    r = client.post("/v1/rollout/completed", headers=project.headers("ingest"), json={
        "rollout_id": episode, "status": "ERROR", "error_message": "boom\u0000"})
    assert_422(r, "error_message")
    r = client.post("/v1/rollout/completed", headers=project.headers("ingest"), json={
        "rollout_id": "x\u0000", "status": "COMPLETED"})
    assert_422(r, "rollout_id")
    detail = client.get(f"/v1/episodes/{episode}", headers=project.headers("read"))
    assert [e["type"] for e in detail.json()["events"]] == ["episode_started"]


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/runs/{run}/leases", {"groups": True}, "groups"),
    ("/v1/runs/{run}/leases", {"current_version": 2**40, "max_staleness": 1}, "current_version"),
    ("/v1/leases/00000000-0000-0000-0000-000000000000/ack", {"policy_version": 2**40},
     "policy_version"),
    ("/v1/leases/00000000-0000-0000-0000-000000000000/ack", {"policy_version": True},
     "policy_version"),
])
def test_lease_numbers_are_integers_in_range(client: TestClient, project: Project, path: str,
                                             body: dict[str, Any], field: str) -> None:
    run_id = create_run(client, project)
    r = client.post(path.format(run=run_id), json=body, headers=project.headers("train"))
    assert_422(r, field)
