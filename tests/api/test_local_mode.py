"""Local mode (``TRAJSTORE_LOCAL_MODE`` / ``trajstore serve --local``): a request without a
key acts as the admin of the local project, on loopback only; it is said at start, in
``/health`` and on every web page. A server started without it still answers 401."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from store.eventlog import EventStore
from store.settings import Settings
from tests.api.conftest import Project
from tests.api.test_ingest import llm_event
from trajstore.api_cli import is_loopback

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def local_project() -> str:
    return f"local-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def local(api_settings: Settings, api_store: EventStore, local_project: str
          ) -> Iterator[TestClient]:
    settings = api_settings.model_copy(update={"local_mode": True,
                                               "local_project": local_project})
    with TestClient(create_app(settings, store=api_store)) as c:
        yield c


def ingest_and_read(http: Any, **headers: str) -> tuple[str, str]:
    """Create a run and an episode, append a call, finish it and read it back, with
    ``headers`` (none: no key). Returns the run and episode ids."""
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    r = http.post("/v1/runs", json={"run_id": run_id, "config": {}}, headers=headers)
    assert r.status_code == 201, r.text
    r = http.post(f"/v1/runs/{run_id}/episodes", json={"group_id": "g0"}, headers=headers)
    assert r.status_code == 201, r.text
    episode = r.json()["episode_id"]
    r = http.post(f"/v1/episodes/{episode}/events", headers=headers, json={
        "expected_version": 1, "events": [llm_event(np.random.default_rng(0))]})
    assert r.status_code == 200, r.text
    r = http.get(f"/v1/episodes/{episode}", headers=headers)
    assert r.status_code == 200, r.text
    assert [e["type"] for e in r.json()["events"]] == ["episode_started", "llm_called"]
    listed = http.get("/v1/runs", headers=headers)
    assert listed.status_code == 200
    assert run_id in {run["run_id"] for run in listed.json()["runs"]}
    return run_id, episode


def test_local_mode_takes_a_keyless_ingest_and_read_as_the_local_project(
        local: TestClient, local_project: str, project: Project) -> None:
    ingest_and_read(local)
    me = local.get("/v1/keys/me")
    assert me.status_code == 200
    assert (me.json()["project"], me.json()["role"]) == (local_project, "admin")
    health = local.get("/health").json()
    assert health == {"status": "healthy", "local_mode": True}
    # A key that is sent is still checked: a wrong one is refused, a right one is its own.
    wrong = local.get("/v1/runs", headers={"Authorization": "Bearer tsk_" + "0" * 16 + "_x" * 12})
    assert wrong.status_code == 401
    theirs = local.get("/v1/keys/me", headers=project.headers("read"))
    assert theirs.json()["project"] == project.name
    # The web page needs no sign-in and says local mode on every page.
    page = local.get("/ui", follow_redirects=False)
    assert page.status_code == 200, page.text
    assert "Local mode" in page.text and local_project in page.text
    login = local.get("/ui/login")
    assert "Local mode" in login.text


def test_a_rollout_server_without_key_or_header_records_into_the_default_run(
        api_settings: Settings, api_store: EventStore, local_project: str,
        tiny_model_dir: Path) -> None:
    """Local mode and ``remote_default_run`` together: a remote-rollout call that carries
    only its rollout id (no key, no header) creates the rollout in the local project."""
    run_id = f"default-{uuid.uuid4().hex[:8]}"
    settings = api_settings.model_copy(update={
        "local_mode": True, "local_project": local_project, "remote_default_run": run_id,
        "gateway_engine_model": str(tiny_model_dir), "gateway_max_tokens": 16})
    rollout_id = f"rollout-{uuid.uuid4().hex[:10]}"
    with TestClient(create_app(settings, store=api_store)) as http:
        r = http.post("/v1/chat/completions", json={
            "rollout_id": rollout_id, "messages": [{"role": "user", "content": "5 + 3?"}],
            "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["mask_check"]["status"] == "first_call"
        run = http.get(f"/v1/runs/{run_id}")
        assert run.status_code == 200, run.text
        assert run.json()["project"] == local_project
        episode = http.get(f"/v1/episodes/{rollout_id}").json()
        assert [e["type"] for e in episode["events"]] == ["episode_started", "llm_called"]


def test_a_server_without_local_mode_still_asks_for_a_key(
        client: TestClient, project: Project) -> None:
    for method, path in (("POST", "/v1/runs"), ("GET", "/v1/runs"), ("GET", "/v1/keys/me"),
                         ("POST", "/v1/chat/completions")):
        r = client.request(method, path, json={} if method == "POST" else None)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["code"] == "unauthorized"
    assert client.get("/health").json() == {"status": "healthy"}  # as before
    page = client.get("/ui", follow_redirects=False)
    assert page.status_code == 303 and page.headers["location"].startswith("/ui/login")
    assert "Local mode" not in client.get("/ui/login").text
    ingest_and_read(client, **project.headers("admin"))


def test_serve_local_answers_keyless_requests_and_says_so_at_start(
        start_server: Any, local_project: str) -> None:
    server = start_server(TRAJSTORE_LOCAL_MODE="true", TRAJSTORE_LOCAL_PROJECT=local_project)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.get("/health").json() == {"status": "healthy", "local_mode": True}
        ingest_and_read(http)
        assert http.get("/v1/keys/me").json()["project"] == local_project
    log = server.log_path.read_text(errors="replace")
    assert "LOCAL MODE" in log and local_project in log


def _serve(args: list[str], env: dict[str, str], tmp_path: Path, pg_url: str
           ) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
    environ.update({"TRAJSTORE_DATABASE_URL": pg_url, "TRAJSTORE_DATA_DIR": str(tmp_path),
                    **env})
    return subprocess.run([sys.executable, "-m", "trajstore", "serve", *args], env=environ,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("args", "env", "setting", "address"), [
    (["--local", "--host", "0.0.0.0"], {}, "--host", "0.0.0.0"),
    (["--host", "::"], {"TRAJSTORE_LOCAL_MODE": "1"}, "--host", "::"),
    ([], {"TRAJSTORE_LOCAL_MODE": "true", "TRAJSTORE_API_HOST": "0.0.0.0"},
     "TRAJSTORE_API_HOST", "0.0.0.0"),
])
def test_local_mode_is_refused_at_start_on_an_address_that_is_not_loopback(
        args: list[str], env: dict[str, str], setting: str, address: str, tmp_path: Path,
        pg_url: str) -> None:
    done = _serve(args, env, tmp_path, pg_url)
    assert done.returncode == 2, done.stdout + done.stderr
    said = done.stdout + done.stderr
    assert setting in said and repr(address) in said and "loopback" in said
    assert "Uvicorn running" not in said


def test_loopback_addresses() -> None:
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "", "203.0.113.7", "10.0.0.1", "no-such-host.invalid"):
        assert not is_loopback(host), host
