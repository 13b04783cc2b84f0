"""The last edges of the API closed: strict numbers (a boolean is never a number, one rule
for every numeric field a client sends), refused gateway calls create nothing, and signing
out of the web page ends the session on the server."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.ui.routes import COOKIE
from store.eventlog import EventStore
from store.settings import Settings
from tests.api.conftest import Project

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


def _field(r: Any) -> str:
    assert r.status_code == 422, r.text
    return str(r.json()["error"].get("field") or r.json()["error"]["message"])


@pytest.mark.parametrize("name,value", [
    ("max_tokens", True), ("temperature", False), ("top_p", True), ("seed", True),
    ("max_tokens", "4"), ("temperature", "0.5"),
])
def test_gateway_numbers_refuse_booleans_naming_the_field(
        gateway: TestClient, project: Project, name: str, value: Any) -> None:
    r = gateway.post("/v1/chat/completions",
                     json={"model": "tiny", "messages": MESSAGES, name: value},
                     headers=project.headers("ingest"))
    assert name in _field(r)
    # The same field as a number is taken.
    good = {"max_tokens": 4, "temperature": 0.0, "top_p": 1, "seed": 3}[name]
    ok = gateway.post("/v1/chat/completions",
                      json={"model": "tiny", "messages": MESSAGES, "max_tokens": 4,
                            name: good}, headers=project.headers("ingest"))
    assert ok.status_code == 200, ok.text


def test_completion_numbers_refuse_booleans(gateway: TestClient, project: Project) -> None:
    for body, name in (({"prompt": [1, True, 3]}, "prompt"), ({"logprobs": 2, "prompt": "x",
                                                               "max_tokens": True},
                                                              "max_tokens")):
        r = gateway.post("/v1/completions", json={"model": "tiny", **body},
                         headers=project.headers("ingest"))
        assert name in _field(r)


@pytest.mark.parametrize("path,body,name", [
    ("/rollout", {"max_turns": True}, "max_turns"),
    ("/rollout", {"max_tokens_total": False}, "max_tokens_total"),
    ("/rollout", {"sampling_params": {"temperature": True}}, "temperature"),
    ("/rollout", {"sampling_params": {"max_tokens": True}}, "max_tokens"),
    ("/v1/rollout/init", {"completion_params": {"top_p": True}}, "top_p"),
    ("/v1/rollout/init", {"max_turns": True}, "max_turns"),
])
def test_remote_rollout_fields_refuse_booleans(client: TestClient, project: Project,
                                               path: str, body: dict[str, Any],
                                               name: str) -> None:
    request = {"rollout_id": f"r-{uuid.uuid4().hex[:8]}", "server_url": "http://127.0.0.1:9",
               "messages": MESSAGES, **body}
    if path == "/rollout":
        request["tokenizer_name"] = "qwen3"
    r = client.post(path, json=request, headers=project.headers("ingest"))
    assert name in _field(r)


@pytest.mark.parametrize("report,name", [
    ({"reward": True}, "reward"),
    ({"reward_score": True}, "reward_score"),
    ({"extra_fields": {"reward": True}}, "extra_fields.reward"),
    ({"extra_fields": {"reward_extra_info": {"reward": False}}},
     "extra_fields.reward_extra_info.reward"),
    ({"metrics": {"reward": True}}, "metrics.reward"),
])
def test_rewards_refuse_booleans_and_record_nothing(
        client: TestClient, project: Project, api_store: EventStore,
        report: dict[str, Any], name: str) -> None:
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    assert client.post("/v1/runs", json={"run_id": run_id},
                       headers=project.headers("ingest")).status_code == 201
    episode = f"ep-{uuid.uuid4().hex[:8]}"
    assert client.post(f"/v1/runs/{run_id}/episodes", json={"episode_id": episode, "group_id": "g"},
                       headers=project.headers("ingest")).status_code == 201
    before = api_store.stream_version(episode)
    r = client.post("/v1/rollout/completed", json={
        "rollout_id": episode, "status": "COMPLETED", **report},
        headers=project.headers("ingest"))
    assert name in _field(r)
    assert api_store.stream_version(episode) == before  # neither reward nor finish
    r = client.post(f"/v1/episodes/{episode}/reward", json={"value": True},
                    headers=project.headers("ingest"))
    assert "value" in _field(r)
    r = client.post(f"/v1/episodes/{episode}/finish", json={"reward": False},
                    headers=project.headers("ingest"))
    assert "reward" in _field(r)
    assert api_store.stream_version(episode) == before


def test_lease_and_serving_seconds_refuse_booleans(client: TestClient,
                                                   project: Project) -> None:
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    assert client.post("/v1/runs", json={"run_id": run_id},
                       headers=project.headers("ingest")).status_code == 201
    r = client.post(f"/v1/runs/{run_id}/leases", json={"lease_seconds": True},
                    headers=project.headers("admin"))
    assert "lease_seconds" in _field(r)
    r = client.post(f"/v1/runs/{run_id}/served", headers=project.headers("admin"),
                    json={"version": 0, "engine": "e", "backend": "b", "load_seconds": True})
    assert "load_seconds" in _field(r)


def _counts(store: EventStore) -> tuple[int, int]:
    with store.db.connection() as conn:
        row = conn.execute(
            "SELECT count(*) FILTER (WHERE type = 'run_created'),"
            " count(*) FILTER (WHERE type = 'episode_started') FROM events").fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def test_refused_gateway_calls_create_no_run_and_no_episode(
        gateway: TestClient, project: Project, api_store: EventStore) -> None:
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    episode = f"ep-{uuid.uuid4().hex[:8]}"
    headers = {**project.headers("ingest"), "X-Trajstore-Run": run_id,
               "X-Trajstore-Episode": episode}
    before = _counts(api_store)
    refused = [
        {"model": "tiny", "messages": MESSAGES, "max_tokens": 17},  # over the gateway's 16
        {"model": "tiny", "messages": MESSAGES, "max_tokens": True},
        {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "stream": True,
         "temperature": True},
    ]
    for body in refused:
        r = gateway.post("/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 422, r.text
    r = gateway.post("/v1/completions", json={"model": "tiny", "prompt": "", "max_tokens": 4},
                     headers=headers)
    assert r.status_code == 422, r.text
    assert _counts(api_store) == before
    assert gateway.get(f"/v1/runs/{run_id}", headers=project.headers("read")).status_code \
        == 404
    assert gateway.get(f"/v1/episodes/{episode}",
                       headers=project.headers("read")).status_code == 404
    # The same call, well formed, creates both and records the call.
    ok = gateway.post("/v1/chat/completions",
                      json={"model": "tiny", "messages": MESSAGES, "max_tokens": 4},
                      headers=headers)
    assert ok.status_code == 200, ok.text
    runs, episodes = _counts(api_store)
    assert (runs, episodes) == (before[0] + 1, before[1] + 1)
    types = [r.type for r in api_store.read_stream(episode)]
    assert types == ["episode_started", "llm_called"]
    assert api_store.get_run(run_id).project == project.name


def test_logout_ends_the_session_on_the_server(client: TestClient, project: Project,
                                               api_settings: Settings,
                                               api_store: EventStore) -> None:
    r = client.post("/ui/login", data={"key": project.read, "next": "/ui"},
                    follow_redirects=False)
    assert r.status_code == 303
    session = r.cookies[COOKIE]
    other = client.post("/ui/login", data={"key": project.read, "next": "/ui"},
                        follow_redirects=False).cookies[COOKIE]
    client.cookies.clear()
    client.cookies.set(COOKIE, session, path="/ui")
    assert client.get("/ui", follow_redirects=False).status_code == 200
    out = client.post("/ui/logout", follow_redirects=False)
    assert out.status_code == 303
    # The cookie, kept or copied, no longer signs in: here nor in another API process.
    client.cookies.clear()
    client.cookies.set(COOKIE, session, path="/ui")
    again = client.get("/ui", follow_redirects=False)
    assert again.status_code == 303 and again.headers["location"].startswith("/ui/login")
    with TestClient(create_app(api_settings, store=api_store)) as second:
        second.cookies.set(COOKIE, session, path="/ui")
        assert second.get("/ui", follow_redirects=False).status_code == 303
        # Another session of the same key lives on until it signs out itself.
        second.cookies.clear()
        second.cookies.set(COOKIE, other, path="/ui")
        assert second.get("/ui", follow_redirects=False).status_code == 200
    client.cookies.clear()


def test_an_upstream_failure_creates_no_run_and_no_episode(
        api_settings: Settings, api_store: EventStore, project: Project) -> None:
    from tests.servers import free_port

    settings = api_settings.model_copy(update={
        "gateway_upstream_url": f"http://127.0.0.1:{free_port()}"})
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    episode = f"ep-{uuid.uuid4().hex[:8]}"
    before = _counts(api_store)
    with TestClient(create_app(settings, store=api_store)) as upstream_less:
        r = upstream_less.post("/v1/chat/completions", json={
            "model": "m", "messages": MESSAGES, "max_tokens": 4}, headers={
            **project.headers("ingest"), "X-Trajstore-Run": run_id,
            "X-Trajstore-Episode": episode})
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unreachable"
    assert _counts(api_store) == before
    assert api_store.stream_version(episode) == 0
