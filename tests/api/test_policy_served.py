"""Engines report through the API the policy version they serve (``POST /v1/runs/{id}/served``,
a train key) and anyone with a read key sees each version's take-up
(``GET /v1/runs/{id}/policies``); bad reports are refused with 422 naming the field, unknown
runs with 404, and nothing is stored."""

from __future__ import annotations

import uuid

import pytest
from fastapi.testclient import TestClient

from store.eventlog import EventStore, run_stream_id
from tests.api.conftest import Project


def new_run(client: TestClient, project: Project) -> str:
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    r = client.post("/v1/runs", json={"run_id": run_id}, headers=project.headers("ingest"))
    assert r.status_code == 201, r.text
    checkpoint = client.app.state.ctx.settings.data_dir / "checkpoints" / run_id / "v1"
    r = client.post(f"/v1/runs/{run_id}/events", headers=project.headers("train"), json={
        "expected_version": "any",
        "events": [{"type": "policy_updated", "version": 1, "step": 1,
                    "checkpoint": str(checkpoint)}]})
    assert r.status_code == 200, r.text
    return run_id


def test_report_and_read_the_takeup(client: TestClient, project: Project) -> None:
    run_id = new_run(client, project)
    report = {"version": 1, "engine": "gpu-7:311/AsyncVLLMBackend",
              "backend": "AsyncVLLMBackend", "source": "/srv/ckpt/v1", "load_seconds": 2.5}
    r = client.post(f"/v1/runs/{run_id}/served", json=report,
                    headers=project.headers("train"))
    assert r.status_code == 201, r.text
    assert r.json()["run_id"] == run_id and r.json()["version"] == 3
    r = client.post(f"/v1/runs/{run_id}/served", headers=project.headers("train"),
                    json={"version": 0, "engine": "cpu-1:9/TransformersBackend",
                          "backend": "TransformersBackend"})
    assert r.status_code == 201, r.text

    r = client.get(f"/v1/runs/{run_id}/policies", headers=project.headers("read"))
    assert r.status_code == 200, r.text
    body = r.json()
    assert [v["version"] for v in body["versions"]] == [0, 1]
    base, first = body["versions"]
    assert base["updated_at"] is None and base["engines"][0]["lag_seconds"] is None
    assert first["step"] == 1 and first["updated_at"] is not None
    assert "checkpoint" not in first  # server paths stay on the server
    (engine,) = first["engines"]
    assert engine["engine"] == report["engine"] and engine["load_seconds"] == 2.5
    assert engine["lag_seconds"] >= 0 and first["lag_max_seconds"] == engine["lag_seconds"]
    assert body["serving"] == {report["engine"]: 1, "cpu-1:9/TransformersBackend": 0}


@pytest.mark.parametrize("change,field,words", [
    ({"version": -1}, "body.version", "greater than or equal to 0"),
    ({"version": "1"}, "body.version", "valid integer"),
    ({"version": 1.5}, "body.version", "valid integer"),
    ({"version": True}, "body.version", "valid integer"),
    ({"version": 4}, "version", "has no policy version 4 (its newest is 1)"),
    ({"engine": ""}, "body.engine", "at least 1 character"),
    ({"engine": 12}, "body.engine", "valid string"),
    ({"engine": " "}, "engine", "engine must be 1 to 200 characters"),
    ({"backend": None}, "body.backend", "valid string"),
    ({"load_seconds": -1}, "body.load_seconds", "greater than or equal to 0"),
    ({"load_seconds": "1.5"}, "body.load_seconds", "valid number"),
    ({"load_seconds": True}, "body.load_seconds", "valid number"),
    ({"extra": 1}, "body.extra", "Extra inputs"),
])
def test_bad_reports_are_422_and_store_nothing(client: TestClient, project: Project,
                                               api_store: EventStore, change: dict,
                                               field: str, words: str) -> None:
    run_id = new_run(client, project)
    before = api_store.stream_version(run_stream_id(run_id))
    report = {"version": 1, "engine": "e", "backend": "B"} | change
    r = client.post(f"/v1/runs/{run_id}/served", json=report,
                    headers=project.headers("train"))
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["field"] == field and words in error["message"]
    assert api_store.stream_version(run_stream_id(run_id)) == before


def test_unknown_run_other_project_and_read_key(client: TestClient, project: Project,
                                                other_project: Project) -> None:
    report = {"version": 0, "engine": "e", "backend": "B"}
    r = client.post("/v1/runs/no-such-run/served", json=report,
                    headers=project.headers("train"))
    assert r.status_code == 404 and "no-such-run" in r.json()["error"]["message"]
    assert client.get("/v1/runs/no-such-run/policies",
                      headers=project.headers("read")).status_code == 404
    run_id = new_run(client, project)
    r = client.post(f"/v1/runs/{run_id}/served", json=report,
                    headers=other_project.headers("train"))
    assert r.status_code == 403
    for role in ("read", "ingest"):  # an engine report changes state: train or admin only
        r = client.post(f"/v1/runs/{run_id}/served", json=report, headers=project.headers(role))
        assert r.status_code == 403 and "'train'" in r.json()["error"]["message"], r.text
    # The raw append route does not take policy_served: reports go through the checked door.
    r = client.post(f"/v1/runs/{run_id}/events", headers=project.headers("train"), json={
        "expected_version": "any", "events": [{"type": "policy_served", **report}]})
    assert r.status_code == 422 and "does not belong" in r.json()["error"]["message"]
