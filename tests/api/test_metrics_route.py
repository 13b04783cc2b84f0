"""``/metrics`` over HTTP: Prometheus text, behind a key."""

from __future__ import annotations

from fastapi.testclient import TestClient


def test_metrics_need_a_key_and_speak_prometheus(client: TestClient, project) -> None:
    assert client.get("/metrics").status_code == 401
    # The figures count every project's runs and samples: an admin key only.
    for role in ("read", "ingest"):
        assert client.get("/metrics", headers=project.headers(role)).status_code == 403
    response = client.get("/metrics", headers=project.headers("admin"))
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    body = response.text
    for name in ("trajstore_events_total", "trajstore_replay_lag_seconds", "trajstore_samples",
                 "trajstore_lease_expiries_total", "trajstore_trainer_tokens_per_second",
                 "trajstore_append_seconds"):
        assert f"# TYPE {name} " in body
