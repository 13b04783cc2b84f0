"""A run's tokenizer is checked when the run is created, by the one rule replay loads by."""

from __future__ import annotations

import uuid

import pytest
from fastapi.testclient import TestClient

from tests.api.conftest import Project
from workers.engines.tokenizers import canonical_tokenizer, load_tokenizer, tokenizer_problem


@pytest.mark.parametrize("name", ["qwen3", "Qwen3", "Qwen/Qwen3-8B", "qwen/qwen3-0.6b", "tiny"])
def test_known_names_are_accepted_and_load(client: TestClient, project: Project,
                                           name: str) -> None:
    run_id = f"tok-{uuid.uuid4().hex[:8]}"
    r = client.post("/v1/runs", json={"run_id": run_id, "config": {"tokenizer": name}},
                    headers=project.headers("ingest"))
    assert r.status_code == 201, r.text
    assert canonical_tokenizer(name) in ("qwen3", "tiny")
    assert len(load_tokenizer(name)) > 0


@pytest.mark.parametrize(("config", "field"), [
    ({"tokenizer": "Qwen/Qwen2.5-7B"}, "body.config.tokenizer"),
    ({"tokenizer": "/no/such/folder"}, "body.config.tokenizer"),
    ({"model": "meta-llama/Llama-3-8B"}, "body.config.model"),
])
def test_a_tokenizer_replay_cannot_load_is_refused(client: TestClient, project: Project,
                                                   config: dict[str, str], field: str) -> None:
    run_id = f"tok-{uuid.uuid4().hex[:8]}"
    r = client.post("/v1/runs", json={"run_id": run_id, "config": config},
                    headers=project.headers("ingest"))
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["field"] == field
    assert "'qwen3'" in error["message"] and "'tiny'" in error["message"]
    got = client.get(f"/v1/runs/{run_id}", headers=project.headers("read"))
    assert got.status_code == 404  # nothing stored


def test_a_local_folder_is_accepted(tmp_path) -> None:
    assert tokenizer_problem(str(tmp_path)) is not None
    load_tokenizer("qwen3").save_pretrained(tmp_path)
    assert tokenizer_problem(str(tmp_path)) is None
    assert tokenizer_problem(None) is not None and tokenizer_problem("") is not None


def test_health_answers_in_the_remote_rollout_form(client: TestClient) -> None:
    r = client.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "healthy"}
