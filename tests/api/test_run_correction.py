"""A run's whole configuration is checked when the run is created: an out-of-range or
conflicting setting (off-policy correction, EGPO, rollout, negatives, a chat template that does
not parse) is a 422 naming the
field, and the run is not stored."""

from __future__ import annotations

import json
import uuid

import pytest
from fastapi.testclient import TestClient

from tests.api.conftest import Project

REFUSED = [
    ({"correction": {"is_level": "seq"}}, "correction.is_level"),
    ({"correction": {"is_threshold": 0.5}}, "correction.is_threshold"),
    ({"correction": {"rejection": "batch"}}, "correction.rejection"),
    ({"correction": {"rejection": "token", "rejection_upper": 0.99}},
     "correction.rejection_upper"),
    ({"correction": {"rejection_lower": 2.0}}, "correction.rejection_lower"),
    ({"correction": {"is_threshold_lower": 1.5}}, "correction.is_threshold_lower"),
    ({"correction": {"rejection": [{"mode": "seq_mean_k1", "upper": 0.9}]}},
     "correction.rejection[0].upper"),
    ({"correction": {"rejection": [{"mode": "seq_max_k3", "upper": 1, "lower": 0.5}]}},
     "correction.rejection[0].lower"),
    ({"correction": {"rejection": [{"mode": "token_k2", "upper": 1},
                                   {"mode": "token_k2", "upper": 2}]}},
     "correction.rejection[1].mode"),
    ({"correction": {"mode": "bypass"}}, "correction.is_level"),
    ({"correction": {"loss_type": "reinforce"}}, "correction.loss_type"),
    ({"correction": {"is_level": "none", "is_batch_normalize": True}},
     "correction.is_batch_normalize"),
    ({"egpo": {"variant": "paper", "alpha": 1.0}}, "egpo.alpha"),
    ({"egpo": {"variant": "paper", "alpha": 0.5, "lam": 0.1}}, "egpo.alpha"),
    ({"egpo": {"lam": 2.5}}, "egpo.lam"),
    ({"chat_template": "{{ messages[0].content "}, "chat_template"),
]


@pytest.mark.parametrize(("config", "field"), REFUSED)
def test_bad_config_is_refused_at_run_creation(client: TestClient, project: Project,
                                               config: dict, field: str) -> None:
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
    ({"correction": {"rejection": [{"mode": "token_k3", "upper": "NaN"}]}},
     "correction.rejection[0].upper"),
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
    correction = {"mode": "bypass", "loss_type": "reinforce", "is_level": "sequence",
                  "is_threshold": 3.0, "is_threshold_lower": 0.5, "is_batch_normalize": True,
                  "rejection": [{"mode": "seq_mean_k1", "upper": 1.01, "lower": 0.99},
                                {"mode": "seq_max_k3", "upper": 0.2, "lower": None}]}
    r = client.post("/v1/runs", json={"run_id": run_id, "config": {"correction": correction}},
                    headers=project.headers("ingest"))
    assert r.status_code == 201, r.text
    got = client.get(f"/v1/runs/{run_id}", headers=project.headers("read")).json()
    assert got["config"]["correction"] == correction
    # The older form (one k1 band) is stored as its rule.
    older = f"run-{uuid.uuid4().hex[:8]}"
    r = client.post("/v1/runs", json={"run_id": older, "config": {"correction": {
        "rejection": "token", "rejection_upper": 4.0, "rejection_lower": 0.5}}},
        headers=project.headers("ingest"))
    assert r.status_code == 201, r.text
    got = client.get(f"/v1/runs/{older}", headers=project.headers("read")).json()
    assert got["config"]["correction"]["rejection"] == [
        {"mode": "token_k1", "upper": 4.0, "lower": 0.5}]
    default = f"run-{uuid.uuid4().hex[:8]}"
    assert client.post("/v1/runs", json={"run_id": default},
                       headers=project.headers("ingest")).status_code == 201
    got = client.get(f"/v1/runs/{default}", headers=project.headers("read")).json()
    assert got["config"]["correction"]["mode"] == "decoupled"
    assert got["config"]["correction"]["is_level"] == "token"
    assert got["config"]["correction"]["is_threshold"] == 2.0
