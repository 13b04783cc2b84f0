"""Batches over HTTP: lease complete groups as JSON or Parquet, acknowledge, release, renew,
expiry."""

from __future__ import annotations

import base64
import datetime as dt
import io
import uuid
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient

from store.eventlog import EventStore
from store.leasing import Leasing
from tests.api.conftest import Project
from tests.api.episodes import create_run, record_group
from tests.factories import database_now


@pytest.fixture(scope="module")
def qwen3() -> Any:
    from workers.engines.tokenizers import load_tokenizer

    return load_tokenizer("qwen3")


@pytest.fixture
def run(api_store: EventStore, project: Project, qwen3: Any) -> str:
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    create_run(api_store, run_id, project=project.name, group_size=2, max_negatives=1)
    record_group(api_store, qwen3, run_id=run_id, group_id="g0", failed_attempt=True)
    record_group(api_store, qwen3, run_id=run_id, group_id="g1")
    return run_id


def test_lease_ack_release_over_http(client: TestClient, project: Project, run: str) -> None:
    headers = project.headers("train")
    first = client.post(f"/v1/runs/{run}/leases", json={"groups": 1, "trainer": "verl-0"},
                        headers=headers)
    assert first.status_code == 200, first.text
    lease = first.json()
    (group,) = lease["groups"]
    assert {s["uid"] for s in lease["samples"]} == {group}
    negatives = [s for s in lease["samples"] if s["is_negative"]]
    assert len(negatives) == (1 if group == "g0" else 0)
    for s in lease["samples"]:
        assert len(s["response_ids"]) == len(s["response_mask"]) == len(s["rollout_log_probs"])
        assert s["response_mask"][0] == 1 and s["status"] == "leased"

    second = client.post(f"/v1/runs/{run}/leases", json={"groups": 1, "format": "parquet"},
                         headers=headers)
    assert second.status_code == 200
    assert second.headers["content-type"] == "application/vnd.apache.parquet"
    other = second.headers["x-trajstore-lease-groups"]
    assert other != group and other in ("g0", "g1")
    rows = pq.read_table(io.BytesIO(second.content)).to_pylist()
    assert {r["uid"] for r in rows} == {other} and rows
    second_id = second.headers["x-trajstore-lease-id"]

    nothing = client.post(f"/v1/runs/{run}/leases", json={"groups": 4}, headers=headers)
    assert nothing.status_code == 204 and nothing.content == b""

    acked = client.post(f"/v1/leases/{lease['lease_id']}/ack", json={"policy_version": 1},
                        headers=headers)
    assert acked.status_code == 200 and acked.json()["consumed"] == len(lease["samples"])
    again = client.post(f"/v1/leases/{lease['lease_id']}/ack", json={"policy_version": 1},
                        headers=headers)
    assert again.json()["consumed"] == len(lease["samples"])
    late = client.post(f"/v1/leases/{lease['lease_id']}/release", headers=headers)
    assert late.status_code == 409 and late.json()["error"]["code"] == "lease_ended"

    renewed = client.post(f"/v1/leases/{second_id}/renew", json={"lease_seconds": 3600},
                          headers=headers)
    assert renewed.status_code == 200
    released = client.post(f"/v1/leases/{second_id}/release", headers=headers)
    assert released.status_code == 200 and released.json()["released"] == len(rows)
    # Released samples come back, here as base64 columns.
    back = client.post(f"/v1/runs/{run}/leases", json={"groups": 1, "encoding": "base64"},
                       headers=headers).json()
    assert back["groups"] == [other]
    by_id = {r["sample_id"]: r for r in rows}
    for s in back["samples"]:
        ids = np.frombuffer(base64.b64decode(s["response_ids"]), "<i4").tolist()
        assert ids == by_id[s["sample_id"]]["response_ids"]
    stats = client.get(f"/v1/runs/{run}", headers=headers).json()["samples"]
    assert stats["consumed"] == len(lease["samples"]) and stats["leased"] == len(rows)


def test_expired_lease_cannot_be_acknowledged(client: TestClient, project: Project,
                                              run: str, api_store: EventStore) -> None:
    headers = project.headers("train")
    lease = client.post(f"/v1/runs/{run}/leases", json={"groups": 2, "lease_seconds": 60},
                        headers=headers).json()
    # Expire it as of two minutes from now instead of waiting.
    Leasing(api_store).expire(now=database_now(api_store) + dt.timedelta(minutes=2))
    # The next lease call takes the groups again.
    retaken = client.post(f"/v1/runs/{run}/leases", json={"groups": 2}, headers=headers)
    assert sorted(retaken.json()["groups"]) == sorted(lease["groups"])
    r = client.post(f"/v1/leases/{lease['lease_id']}/ack", json={"policy_version": 2},
                    headers=headers)
    assert r.status_code == 409 and r.json()["error"]["code"] == "lease_ended"


def test_bad_lease_requests(client: TestClient, project: Project, run: str) -> None:
    headers = project.headers("train")
    r = client.post("/v1/leases/not-a-uuid/ack", json={"policy_version": 1}, headers=headers)
    assert r.status_code == 422 and r.json()["error"]["field"] == "path.lease_id"
    r = client.post(f"/v1/leases/{uuid.uuid4()}/ack", json={"policy_version": 1},
                    headers=headers)
    assert r.status_code == 404
    r = client.post(f"/v1/runs/{run}/leases", json={"groups": 0}, headers=headers)
    assert r.status_code == 422 and r.json()["error"]["field"] == "body.groups"
    r = client.post(f"/v1/runs/{run}/leases", json={"format": "csv"}, headers=headers)
    assert r.status_code == 422 and r.json()["error"]["field"] == "body.format"
