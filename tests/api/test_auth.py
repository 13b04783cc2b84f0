"""The 401/403 matrix over every authenticated route, and key revocation."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.keys import KeyStore
from store.analytics import VIEWS
from store.eventlog import EventStore
from store.leasing import Leasing
from store.settings import Settings
from tests.api.conftest import Project
from tests.api.episodes import create_run, record_group
from tests.workers.conftest import wait_for


@pytest.fixture(scope="module")
def qwen3() -> Any:
    from workers.engines.tokenizers import load_tokenizer

    return load_tokenizer("qwen3")


def routes(run: str, episode: str, lease: str) -> list[tuple[str, str, str, Callable[[], Any]]]:
    """(method, path, role needed, body factory) of every route that needs a key."""
    return [
        ("GET", "/v1/keys/me", "any", lambda: None),
        ("GET", "/metrics", "admin", lambda: None),
        ("POST", "/v1/runs", "ingest", lambda: {"run_id": f"r-{uuid.uuid4().hex[:8]}"}),
        ("GET", "/v1/runs", "read", lambda: None),
        ("GET", f"/v1/runs/{run}", "read", lambda: None),
        ("POST", f"/v1/runs/{run}/events", "train", lambda: {
            "expected_version": "any",
            "events": [{"type": "policy_updated", "version": 1, "step": 1}]}),
        ("POST", f"/v1/runs/{run}/served", "train", lambda: {
            "version": 0, "engine": "host:1/TransformersBackend", "backend": "transformers"}),
        ("GET", f"/v1/runs/{run}/policies", "read", lambda: None),
        ("POST", f"/v1/runs/{run}/episodes", "ingest", lambda: {"group_id": "gx"}),
        ("POST", f"/v1/episodes/{episode}/events", "ingest", lambda: {
            "expected_version": "any", "events": [{"type": "reward_assigned", "value": 0.5}]}),
        ("GET", f"/v1/episodes?run_id={run}", "read", lambda: None),
        ("GET", f"/v1/episodes/{episode}", "read", lambda: None),
        ("GET", f"/v1/episodes/{episode}/timelines", "read", lambda: None),
        ("GET", f"/v1/runs/{run}/samples", "read", lambda: None),
        ("GET", f"/v1/runs/{run}/export.parquet", "read", lambda: None),
        ("GET", f"/v1/runs/{run}/export?format=atif", "read", lambda: None),
        ("POST", f"/v1/runs/{run}/leases", "train", lambda: {"groups": 1}),
        ("POST", f"/v1/leases/{lease}/renew", "train", lambda: {"lease_seconds": 60}),
        ("POST", f"/v1/leases/{lease}/ack", "train", lambda: {"policy_version": 1}),
        ("POST", f"/v1/leases/{lease}/release", "train", lambda: None),
        ("POST", "/v1/chat/completions", "ingest", lambda: {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "rollout_id": episode}),
        ("POST", "/v1/completions", "ingest", lambda: {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "rollout_id": episode}),
        ("POST", "/v1/rollout/completed", "ingest", lambda: {
            "rollout_id": episode, "status": "COMPLETED"}),
        # A trainer host that is not allowed: refused (422) after the key's checks, before
        # anything is queued.
        ("POST", "/rollout", "ingest", lambda: {
            "rollout_id": uuid.uuid4().hex, "server_url": "http://203.0.113.7:9",
            "messages": [{"role": "user", "content": "hi"}], "tokenizer_name": "qwen3",
            "run_id": run, "max_turns": 1}),
        ("POST", "/v1/rollout/init", "ingest", lambda: {
            "rollout_id": uuid.uuid4().hex, "server_url": "http://203.0.113.7:9",
            "messages": [{"role": "user", "content": "hi"}], "run_id": run,
            "max_turns": 1}),
        ("GET", "/tools", "any", lambda: None),
        ("GET", "/v1/models", "ingest", lambda: None),
        ("GET", "/v1/models/trajstore", "ingest", lambda: None),
        ("GET", f"/v1/runs/{run}/episodes/{episode}/models", "ingest", lambda: None),
        ("GET", f"/v1/runs/{run}/episodes/{episode}/models/trajstore", "ingest", lambda: None),
        ("POST", f"/v1/runs/{run}/episodes/{episode}/chat/completions", "ingest", lambda: {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        ("POST", f"/v1/runs/{run}/episodes/{episode}/completions", "ingest", lambda: {
            "prompt": "hi", "max_tokens": 2}),
        ("POST", f"/v1/episodes/{episode}/reward", "ingest", lambda: {"value": 0.5}),
        *(("GET", f"/v1/runs/{run}/analytics/{name}", "read", lambda: None)
          for name in VIEWS),
        ("POST", "/v1/traces", "ingest", lambda: {"resourceSpans": [{"scopeSpans": [{"spans": [{
            "traceId": uuid.uuid4().hex, "spanId": uuid.uuid4().hex[:16], "name": "tool",
            "startTimeUnixNano": "1700000000000000000", "attributes": [
                {"key": "gen_ai.operation.name", "value": {"stringValue": "execute_tool"}},
                {"key": "gen_ai.tool.name", "value": {"stringValue": "ls"}},
                {"key": "gen_ai.conversation.id", "value": {"stringValue": episode}}]}]}]}]}),
        ("POST", "/v1/datasets", "ingest", lambda: {"name": "matrix-ds", "runs": [run]}),
        ("GET", "/v1/datasets", "read", lambda: None),
        ("GET", "/v1/datasets/diff?a=matrix-ds@1&b=matrix-ds", "read", lambda: None),
        ("GET", "/v1/datasets/matrix-ds", "read", lambda: None),
        ("GET", "/v1/datasets/matrix-ds/versions/1", "read", lambda: None),
        ("GET", "/v1/datasets/matrix-ds/versions/1/rows", "read", lambda: None),
        ("GET", "/v1/datasets/matrix-ds/versions/1/export", "read", lambda: None),
        ("DELETE", "/v1/datasets/matrix-ds/versions/1", "admin", lambda: None),
        ("GET", f"/v1/runs/{run}/steps/1/lineage", "read", lambda: None),
        ("GET", f"/v1/episodes/{episode}/lineage", "read", lambda: None),
        ("POST", f"/v1/episodes/{episode}/credentials", "admin", lambda: {"ttl_s": 60}),
        # A key id that is no credential of the episode: 404 after the key's checks.
        ("DELETE", f"/v1/episodes/{episode}/credentials/0123456789abcdef", "admin",
         lambda: None),
        # A turn the episode does not hold: 404 after the key's checks, nothing queued.
        ("POST", f"/v1/episodes/{episode}/branches", "ingest", lambda: {"turn": 999}),
        # Last: it closes the episode the routes above write to.
        ("POST", f"/v1/episodes/{episode}/finish", "ingest", lambda: {}),
    ]


#: Routes that touch one resource of a project (another project's key gets 403).
_SCOPED = {"/v1/runs/", "/v1/episodes/", "/v1/leases/", "/v1/episodes?run_id",
           "/v1/chat/completions", "/v1/completions", "/v1/rollout/completed", "/rollout",
           "/v1/rollout/init",
           "/v1/traces"}
#: Remote-rollout calls: another project's rollout id is a conflict, not a 403.
_ROLLOUT_IDS = {"/v1/chat/completions", "/v1/completions"}


def _send(client: TestClient, method: str, path: str, body: Any,
          headers: dict[str, str]) -> Any:
    return client.request(method, path, json=body, headers=headers)


def test_every_route_needs_a_valid_key_and_the_right_role_and_project(
        client: TestClient, project: Project, other_project: Project,
        api_store: EventStore, key_store: KeyStore, qwen3: Any) -> None:
    run = f"run-{uuid.uuid4().hex[:8]}"
    create_run(api_store, run, project=project.name, group_size=1)
    episode = record_group(api_store, qwen3, run_id=run, group_id="g0", size=1)[0]
    record_group(api_store, qwen3, run_id=run, group_id="g1", size=1)
    lease = Leasing(api_store).lease_batch(run, groups=1, lease_seconds=600)
    assert lease is not None
    revoked = key_store.create(project=project.name, role="admin")
    key_store.revoke(revoked.key.key_id)
    covered = {(m, p.split("?")[0]) for m, p, *_ in routes(run, episode, str(lease.lease_id))}
    documented = {(m.upper(), p) for p, item in client.app.openapi()["paths"].items()
                  for m in item}
    public = {("GET", "/health"), ("GET", "/ready")}
    templated = {(m, p.replace(run, "{run_id}").replace(episode, "{episode_id}")
                  .replace(str(lease.lease_id), "{lease_id}")
                  .replace("/models/trajstore", "/models/{model_id}")
                  .replace("/credentials/0123456789abcdef", "/credentials/{key_id}")
                  .replace("/matrix-ds", "/{dataset}")
                  .replace("/versions/1", "/versions/{version}")
                  .replace("/steps/1/", "/steps/{step}/"))
                 for m, p in covered}
    assert templated | public == documented, "the matrix must cover every route"

    for method, path, role, body in routes(run, episode, str(lease.lease_id)):
        where = f"{method} {path}"
        r = _send(client, method, path, body(), {})
        assert r.status_code == 401, where
        assert r.json()["error"]["code"] == "unauthorized" and \
            r.headers["www-authenticate"] == "Bearer", where
        for bad in ("Bearer nonsense", "Bearer tsk_0123456789abcdef_" + "x" * 43,
                    f"Bearer {revoked.token}"):
            r = _send(client, method, path, body(), {"Authorization": bad})
            assert r.status_code == 401, (where, bad)
        if role != "any":
            # Reading never changes state: a read key only reads; train also reads.
            wrongs = {"ingest": ["read", "train"], "read": ["ingest"],
                      "train": ["read", "ingest"], "admin": ["ingest", "read", "train"]}[role]
            for wrong in wrongs:
                r = _send(client, method, path, body(), project.headers(wrong))
                assert r.status_code == 403, (where, wrong)
                error = r.json()["error"]
                assert error["code"] == "forbidden", where
                assert f"needs {role!r}" in error["message"], (where, error)
            if role == "read":
                r = _send(client, method, path, body(), project.headers("train"))
                assert r.status_code not in (401, 403), (where, r.text)
        if path in _ROLLOUT_IDS:
            # A rollout id of another project is taken, and nothing says whose (409).
            for other in (role, "admin"):
                r = _send(client, method, path, body(), other_project.headers(other))
                assert r.status_code == 409, (where, r.text)
                assert r.json()["error"]["code"] == "rollout_id_taken", where
                assert project.name not in r.text and run not in r.text, where
        elif any(path.startswith(s) for s in _SCOPED) and role != "any":
            r = _send(client, method, path, body(), other_project.headers(role))
            assert r.status_code == 403, (where, r.text)
            r = _send(client, method, path, body(), other_project.headers("admin"))
            assert r.status_code == 403, where
        r = _send(client, method, path, body(),
                  {"X-API-Key": project.admin})
        assert r.status_code not in (401, 403), (where, r.text)


def test_revocation_reaches_a_process_that_trusts_the_key(
        client: TestClient, key_store: KeyStore, project: Project) -> None:
    new = key_store.create(project=project.name, role="read", name="short-lived")
    headers = {"Authorization": f"Bearer {new.token}"}
    app_keys = client.app.state.ctx.keys
    # Once the app hears revocations, it trusts the checked key without reading its row.
    wait_for(lambda: client.get("/v1/keys/me", headers=headers).status_code == 200
             and app_keys._listening, timeout=30, what="the app listening for revocations")
    me = client.get("/v1/keys/me", headers=headers)
    assert me.json() == {"key_id": new.key.key_id, "project": project.name, "role": "read"}
    with app_keys.db.connection() as conn:  # proof that the row is not read: change it
        conn.execute("UPDATE api_keys SET project = 'elsewhere' WHERE key_id = %s",
                     (new.key.key_id,))
    assert client.get("/v1/keys/me", headers=headers).json()["project"] == project.name
    # Another process (the CLI) revokes it: the app drops it as the notification arrives.
    key_store.revoke(new.key.key_id)
    wait_for(lambda: client.get("/v1/keys/me", headers=headers).status_code == 401,
             timeout=30, what="the revocation to reach the app")


def test_without_trust_window_every_request_reads_the_row(
        api_settings: Settings, api_store: EventStore, key_store: KeyStore,
        project: Project) -> None:
    settings = api_settings.model_copy(update={"api_key_cache_s": 0.0})
    with TestClient(create_app(settings, store=api_store)) as c:
        new = key_store.create(project=project.name, role="read")
        headers = {"Authorization": f"Bearer {new.token}"}
        assert c.get("/v1/keys/me", headers=headers).status_code == 200
        KeyStore(key_store.db, settings).revoke(new.key.key_id)
        assert c.get("/v1/keys/me", headers=headers).status_code == 401


def test_a_project_sees_only_its_runs(client: TestClient, project: Project,
                                      other_project: Project) -> None:
    run = f"run-{uuid.uuid4().hex[:8]}"
    assert client.post("/v1/runs", json={"run_id": run},
                       headers=project.headers("ingest")).status_code == 201
    mine = client.get("/v1/runs", headers=project.headers("read")).json()["runs"]
    theirs = client.get("/v1/runs", headers=other_project.headers("read")).json()["runs"]
    assert [r["run_id"] for r in mine] == [run]
    assert theirs == []
    r = client.post("/v1/runs", json={"run_id": f"r-{uuid.uuid4().hex[:6]}",
                                      "project": other_project.name},
                    headers=project.headers("admin"))
    assert r.status_code == 403
    assert client.get(f"/v1/runs/{run}-missing",
                      headers=project.headers("read")).status_code == 404
