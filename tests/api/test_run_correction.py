"""The off-policy correction of a run is validated when the run is created: a bad mode or
threshold is a 422 naming the field, and the run is not stored."""

from __future__ import annotations

import uuid

import pytest
from fastapi.testclient import TestClient

from tests.api.conftest import Project


@pytest.mark.parametrize(("field", "value"), [
    ("is_level", "seq"), ("is_threshold", 0.5), ("rejection", "batch"),
    ("rejection_upper", 0.99), ("rejection_lower", 2.0),
])
def test_bad_correction_is_refused_at_run_creation(client: TestClient, project: Project,
                                                   field: str, value: object) -> None:
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    r = client.post("/v1/runs", json={"run_id": run_id, "config": {"correction": {field: value}}},
                    headers=project.headers("ingest"))
    assert r.status_code == 422, r.text
    assert r.json()["error"]["field"] == f"body.config.correction.{field}"
    assert client.get(f"/v1/runs/{run_id}", headers=project.headers("read")).status_code == 404


def test_correction_is_stored_with_the_run(client: TestClient, project: Project) -> None:
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    correction = {"is_level": "sequence", "is_threshold": 3.0, "rejection": "token",
                  "rejection_upper": 4.0, "rejection_lower": 0.5}
    r = client.post("/v1/runs", json={"run_id": run_id, "config": {"correction": correction}},
                    headers=project.headers("ingest"))
    assert r.status_code == 201, r.text
    got = client.get(f"/v1/runs/{run_id}", headers=project.headers("read")).json()
    assert got["config"]["correction"] == correction
    default = f"run-{uuid.uuid4().hex[:8]}"
    assert client.post("/v1/runs", json={"run_id": default},
                       headers=project.headers("ingest")).status_code == 201
    got = client.get(f"/v1/runs/{default}", headers=project.headers("read")).json()
    assert got["config"]["correction"]["is_level"] == "token"
    assert got["config"]["correction"]["is_threshold"] == 2.0
