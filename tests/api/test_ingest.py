"""Ingest over HTTP: runs, episodes, batches with expected versions and event ids
(idempotent retry, 409, 422 with index and field, 413), both token encodings."""

from __future__ import annotations

import base64
import uuid

import numpy as np
from fastapi.testclient import TestClient

from store.eventlog import EventStore
from tests.api.conftest import Project


def create_run(client: TestClient, project: Project, run_id: str | None = None,
               **config: object) -> str:
    run_id = run_id or f"run-{uuid.uuid4().hex[:8]}"
    r = client.post("/v1/runs", json={"run_id": run_id, "config": config},
                    headers=project.headers("ingest"))
    assert r.status_code == 201, r.text
    return run_id


def start_episode(client: TestClient, project: Project, run_id: str, group: str = "g0",
                  **extra: object) -> str:
    r = client.post(f"/v1/runs/{run_id}/episodes", json={"group_id": group, **extra},
                    headers=project.headers("ingest"))
    assert r.status_code == 201, r.text
    return str(r.json()["episode_id"])


def llm_event(rng: np.random.Generator, *, n_prompt: int = 30, n_response: int = 10,
              base64_tokens: bool = False) -> dict[str, object]:
    prompt = rng.integers(0, 150_000, n_prompt).astype(np.int32)
    response = rng.integers(0, 150_000, n_response).astype(np.int32)
    logprobs = -rng.random(n_response).astype(np.float32)
    event: dict[str, object] = {
        "type": "llm_called", "event_id": str(uuid.uuid4()), "call_id": uuid.uuid4().hex,
        "messages": [{"role": "user", "content": "hi"}],
        "response": {"role": "assistant", "content": "hello"},
    }
    if base64_tokens:
        event["prompt_ids"] = base64.b64encode(prompt.astype("<i4").tobytes()).decode()
        event["response_ids"] = base64.b64encode(response.astype("<i4").tobytes()).decode()
        event["logprobs"] = base64.b64encode(logprobs.astype("<f4").tobytes()).decode()
    else:
        event["prompt_ids"] = prompt.tolist()
        event["response_ids"] = response.tolist()
        event["logprobs"] = logprobs.tolist()
    return event


def test_create_run_then_retry_is_idempotent_and_a_clash_is_409(client: TestClient,
                                                                 project: Project) -> None:
    event_id = str(uuid.uuid4())
    body = {"run_id": f"run-{uuid.uuid4().hex[:8]}", "event_id": event_id,
            "config": {"group_size": 4, "egpo": {"lam": 0.2, "alpha": 3.0, "variant": "paper"},
                       "tokenizer": "qwen3"}}
    first = client.post("/v1/runs", json=body, headers=project.headers("ingest"))
    assert first.status_code == 201 and first.json()["duplicate"] is False
    again = client.post("/v1/runs", json=body, headers=project.headers("ingest"))
    assert again.status_code == 200 and again.json()["duplicate"] is True
    assert again.json()["position"] == first.json()["position"]
    clash = client.post("/v1/runs", json={**body, "event_id": str(uuid.uuid4())},
                        headers=project.headers("ingest"))
    assert clash.status_code == 409 and clash.json()["error"]["code"] == "already_exists"
    got = client.get(f"/v1/runs/{body['run_id']}", headers=project.headers("read")).json()
    assert got["project"] == project.name
    assert got["config"]["egpo"] == {"lam": 0.2, "alpha": 3.0, "variant": "paper"}
    assert got["config"]["group_size"] == 4
    assert got["episodes"] == {"started": 0}


def test_run_config_errors_name_the_field(client: TestClient, project: Project) -> None:
    r = client.post("/v1/runs", json={"run_id": "r-bad", "config": {"group_size": 0}},
                    headers=project.headers("ingest"))
    assert r.status_code == 422
    assert r.json()["error"]["field"] == "body.config.group_size"
    r = client.post("/v1/runs", json={"run_id": "r-bad", "config": {"egpo": {"variant": "x"}}},
                    headers=project.headers("ingest"))
    assert r.status_code == 422 and r.json()["error"]["field"] == "body.config.egpo.variant"


def test_append_batch_with_both_encodings_reads_back_the_same_tokens(
        client: TestClient, project: Project, api_store: EventStore) -> None:
    rng = np.random.default_rng(0)
    run_id = create_run(client, project)
    episode = start_episode(client, project, run_id)
    as_json = llm_event(rng)
    as_b64 = llm_event(rng, base64_tokens=True)
    r = client.post(f"/v1/episodes/{episode}/events",
                    json={"expected_version": 1, "events": [as_json, as_b64]},
                    headers=project.headers("ingest"))
    assert r.status_code == 200, r.text
    assert r.json()["version"] == 3 and len(r.json()["positions"]) == 2
    stored = api_store.read_stream(episode)
    assert [e.type for e in stored] == ["episode_started", "llm_called", "llm_called"]
    assert stored[1].event.prompt_ids.tolist() == as_json["prompt_ids"]
    decoded = np.frombuffer(base64.b64decode(str(as_b64["response_ids"])), "<i4")
    assert stored[2].event.response_ids.tolist() == decoded.tolist()
    lp = np.frombuffer(base64.b64decode(str(as_b64["logprobs"])), "<f4")
    assert np.array_equal(stored[2].event.logprobs, lp)
    # Read back through the API in base64: the same bytes.
    got = client.get(f"/v1/episodes/{episode}", params={"encoding": "base64"},
                     headers=project.headers("read")).json()
    assert got["events"][2]["tokens"]["response_ids"] == as_b64["response_ids"]
    assert got["events"][1]["tokens"]["prompt_ids"] == base64.b64encode(
        np.asarray(as_json["prompt_ids"], "<i4").tobytes()).decode()


def test_retry_is_idempotent_and_stale_version_is_409_with_current(
        client: TestClient, project: Project, api_store: EventStore) -> None:
    rng = np.random.default_rng(1)
    run_id = create_run(client, project)
    episode = start_episode(client, project, run_id)
    batch = {"expected_version": 1, "events": [llm_event(rng), llm_event(rng)]}
    first = client.post(f"/v1/episodes/{episode}/events", json=batch,
                        headers=project.headers("ingest"))
    retry = client.post(f"/v1/episodes/{episode}/events", json=batch,
                        headers=project.headers("ingest"))
    assert first.status_code == retry.status_code == 200
    assert retry.json()["duplicate"] is True
    assert retry.json()["positions"] == first.json()["positions"]
    assert api_store.stream_version(episode) == 3
    stale = client.post(f"/v1/episodes/{episode}/events",
                        json={"expected_version": 1, "events": [llm_event(rng)]},
                        headers=project.headers("ingest"))
    assert stale.status_code == 409
    err = stale.json()["error"]
    assert err["code"] == "version_conflict" and err["current_version"] == 3
    assert api_store.stream_version(episode) == 3


def test_invalid_event_is_422_with_index_and_field_and_nothing_is_stored(
        client: TestClient, project: Project, api_store: EventStore) -> None:
    rng = np.random.default_rng(2)
    run_id = create_run(client, project)
    episode = start_episode(client, project, run_id)
    bad = llm_event(rng)
    bad["logprobs"] = bad["logprobs"][:-1]  # type: ignore[index]
    r = client.post(f"/v1/episodes/{episode}/events",
                    json={"expected_version": 1,
                          "events": [llm_event(rng), llm_event(rng), bad]},
                    headers=project.headers("ingest"))
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["event_index"] == 2 and err["field"] == "logprobs"
    assert "equal length" in err["message"]
    assert api_store.stream_version(episode) == 1
    # A nested field path, an unknown type, a bad base64 string.
    nested = {"type": "attempt_failed", "checkpoint_id": "c", "position_key": "turn_x",
              "retry_index": 0}
    r = client.post(f"/v1/episodes/{episode}/events",
                    json={"expected_version": 1, "events": [nested]},
                    headers=project.headers("ingest"))
    assert r.status_code == 422 and r.json()["error"]["field"] == "position_key"
    r = client.post(f"/v1/episodes/{episode}/events",
                    json={"expected_version": 1, "events": [{"type": "nope"}]},
                    headers=project.headers("ingest"))
    assert r.status_code == 422 and r.json()["error"]["field"] == "type"
    b64 = llm_event(rng, base64_tokens=True)
    b64["prompt_ids"] = "not base64!"
    r = client.post(f"/v1/episodes/{episode}/events",
                    json={"expected_version": 1, "events": [llm_event(rng), b64]},
                    headers=project.headers("ingest"))
    assert r.status_code == 422
    assert r.json()["error"]["event_index"] == 1
    assert r.json()["error"]["field"] == "prompt_ids"
    odd = llm_event(rng, base64_tokens=True)
    odd["logprobs"] = base64.b64encode(b"\x00" * 7).decode()
    r = client.post(f"/v1/episodes/{episode}/events",
                    json={"expected_version": 1, "events": [odd]},
                    headers=project.headers("ingest"))
    assert r.status_code == 422 and "multiple of 4" in r.json()["error"]["message"]
    # Run-stream events do not go into an episode.
    r = client.post(f"/v1/episodes/{episode}/events",
                    json={"expected_version": 1,
                          "events": [{"type": "policy_updated", "version": 1, "step": 1}]},
                    headers=project.headers("ingest"))
    assert r.status_code == 422 and r.json()["error"]["event_index"] == 0
    assert api_store.stream_version(episode) == 1


def test_body_over_the_limit_is_413_and_nothing_is_stored(
        client: TestClient, project: Project, api_store: EventStore) -> None:
    rng = np.random.default_rng(3)
    run_id = create_run(client, project)
    episode = start_episode(client, project, run_id)
    big = llm_event(rng, n_prompt=400_000, n_response=10)  # ~2.8 MB of JSON, limit 2 MiB
    r = client.post(f"/v1/episodes/{episode}/events",
                    json={"expected_version": 1, "events": [big]},
                    headers=project.headers("ingest"))
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "payload_too_large"
    assert api_store.stream_version(episode) == 1

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(40):
            yield b" " * 65536

    r = client.post(f"/v1/episodes/{episode}/events", content=chunks(),
                    headers={**project.headers("ingest"), "Content-Type": "application/json"})
    assert r.status_code == 413
    assert api_store.stream_version(episode) == 1


def test_missing_expected_version_and_empty_batch_are_422(client: TestClient,
                                                         project: Project) -> None:
    run_id = create_run(client, project)
    episode = start_episode(client, project, run_id)
    r = client.post(f"/v1/episodes/{episode}/events", json={"events": [{"type": "x"}]},
                    headers=project.headers("ingest"))
    assert r.status_code == 422 and r.json()["error"]["field"] == "body.expected_version"
    r = client.post(f"/v1/episodes/{episode}/events",
                    json={"expected_version": "any", "events": []},
                    headers=project.headers("ingest"))
    assert r.status_code == 422 and r.json()["error"]["field"] == "body.events"


def test_new_stream_opened_by_its_episode_started(client: TestClient, project: Project,
                                                  api_store: EventStore) -> None:
    run_id = create_run(client, project)
    episode = f"ep-{uuid.uuid4().hex[:8]}"
    r = client.post(f"/v1/episodes/{episode}/events", json={
        "expected_version": "no_stream",
        "events": [{"type": "episode_started", "run_id": run_id, "group_id": "g1"},
                   {"type": "reward_assigned", "value": 1.0},
                   {"type": "episode_finished", "status": "completed"}]},
        headers=project.headers("ingest"))
    assert r.status_code == 200, r.text
    assert api_store.stream_version(episode) == 3
    r = client.post(f"/v1/episodes/ep-{uuid.uuid4().hex[:8]}/events", json={
        "expected_version": "any", "events": [{"type": "reward_assigned", "value": 1.0}]},
        headers=project.headers("ingest"))
    assert r.status_code == 404


def test_policy_updated_goes_to_the_run_stream(client: TestClient, project: Project) -> None:
    run_id = create_run(client, project)
    r = client.post(f"/v1/runs/{run_id}/events", json={
        "expected_version": 1, "events": [{"type": "policy_updated", "version": 1, "step": 10}]},
        headers=project.headers("train"))
    assert r.status_code == 200, r.text
    assert client.get(f"/v1/runs/{run_id}",
                      headers=project.headers("read")).json()["policy_version"] == 1
    r = client.post(f"/v1/runs/{run_id}/events", json={
        "expected_version": "any", "events": [{"type": "reward_assigned", "value": 1}]},
        headers=project.headers("train"))
    assert r.status_code == 422 and r.json()["error"]["field"] == "type"


def test_prompts_by_reference_are_stored_in_full(client: TestClient, project: Project,
                                                 api_store: EventStore) -> None:
    rng = np.random.default_rng(7)
    run_id = create_run(client, project)
    episode = start_episode(client, project, run_id)
    first = llm_event(rng, n_prompt=40, n_response=8)
    second = llm_event(rng, n_prompt=1, n_response=6, base64_tokens=True)
    suffix = rng.integers(0, 150_000, 12).astype(np.int32)
    second["prompt_ids"] = {"extends": 0, "suffix": base64.b64encode(
        suffix.astype("<i4").tobytes()).decode()}
    third = llm_event(rng, n_prompt=1, n_response=5)
    third["prompt_ids"] = {"extends": 1, "keep": 50, "suffix": [7, 8, 9]}
    r = client.post(f"/v1/episodes/{episode}/events",
                    json={"expected_version": 1, "events": [first, second, third]},
                    headers=project.headers("ingest"))
    assert r.status_code == 200, r.text
    stored = [e.event for e in api_store.read_stream(episode)[1:]]
    expected_second = first["prompt_ids"] + first["response_ids"] + suffix.tolist()
    assert stored[1].prompt_ids.tolist() == expected_second
    base = expected_second + stored[1].response_ids.tolist()
    assert stored[2].prompt_ids.tolist() == base[:50] + [7, 8, 9]
    # Bad references name the event and the field; nothing is stored.
    for ref, field in (({"extends": 1}, "prompt_ids.extends"),
                       ({"extends": 0, "keep": 999}, "prompt_ids.keep"),
                       ({"extends": 0, "suffix": "%%"}, "prompt_ids.suffix"),
                       ({"extends": 0, "from": 1}, "prompt_ids")):
        bad = llm_event(rng)
        bad["prompt_ids"] = ref
        r = client.post(f"/v1/episodes/{episode}/events",
                        json={"expected_version": 4, "events": [llm_event(rng), bad]},
                        headers=project.headers("ingest"))
        assert r.status_code == 422, (ref, r.text)
        assert r.json()["error"]["event_index"] == 1 and r.json()["error"]["field"] == field
    tool = {"type": "tool_returned", "name": "t"}
    bad = llm_event(rng)
    bad["prompt_ids"] = {"extends": 0}
    r = client.post(f"/v1/episodes/{episode}/events",
                    json={"expected_version": 4, "events": [tool, bad]},
                    headers=project.headers("ingest"))
    assert r.status_code == 422 and "not an llm_called" in r.json()["error"]["message"]
    assert api_store.stream_version(episode) == 4
