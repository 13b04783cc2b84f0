"""A run's whole configuration is checked when the run is created: an out-of-range or
conflicting setting (off-policy correction, EGPO, rollout, negatives, a chat template that does
not parse) is a 422 naming the field, and the run is not stored."""

from __future__ import annotations

import json
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


@pytest.mark.parametrize(("config", "field"), [
    ({"egpo": {"variant": "paper", "alpha": 1.0}}, "egpo.alpha"),
    ({"egpo": {"variant": "paper", "alpha": 0.5, "lam": 0.1}}, "egpo.alpha"),
    ({"egpo": {"lam": 2.5}}, "egpo.lam"),
    ({"chat_template": "{{ messages[0].content "}, "chat_template"),
])
def test_config_that_fails_later_is_refused_at_run_creation(
        client: TestClient, project: Project, config: dict, field: str) -> None:
    """EGPO's sign conditions and the chat template's syntax are checked now, not at the
    first training step or rollout."""
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    r = client.post("/v1/runs", json={"run_id": run_id, "config": config},
                    headers=project.headers("ingest"))
    assert r.status_code == 422, r.text
    assert r.json()["error"]["field"] == f"body.config.{field}"
    assert client.get(f"/v1/runs/{run_id}", headers=project.headers("read")).status_code == 404


@pytest.mark.parametrize(("config", "field"), [
    ({"negatives": {"negative_reward": "Infinity"}}, "negatives.negative_reward"),
    ({"egpo": {"lam": "Infinity"}}, "egpo.lam"),
    ({"rollout": {"temperature": "Infinity"}}, "rollout.temperature"),
    ({"correction": {"is_threshold": "NaN"}}, "correction.is_threshold"),
])
def test_non_finite_numbers_are_refused(client: TestClient, project: Project, config: dict,
                                        field: str) -> None:
    """JSON as Python reads it allows Infinity and NaN literals; a run must not store them (a
    negative reward of Infinity would fail at the first training step)."""
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    body = json.dumps({"run_id": run_id, "config": config}).replace('"Infinity"', "Infinity")
    body = body.replace('"NaN"', "NaN")
    r = client.post("/v1/runs", content=body.encode(), headers={
        **project.headers("ingest"), "Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["field"] == f"body.config.{field}"
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
