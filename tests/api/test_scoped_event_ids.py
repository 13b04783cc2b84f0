"""Event ids scoped by project: an event id another project stored is a 409 that tells
nothing of that event (no position, no stream), while the project that stored it still gets
an idempotent retry; nothing is written for the refused batch."""

from __future__ import annotations

import json

import numpy as np
from fastapi.testclient import TestClient

from store.eventlog import EventStore
from tests.api.conftest import Project
from tests.api.test_ingest import create_run, llm_event, start_episode


def test_another_projects_event_id_is_a_conflict_revealing_nothing(
        client: TestClient, project: Project, other_project: Project,
        api_store: EventStore) -> None:
    rng = np.random.default_rng(7)
    mine = start_episode(client, project, create_run(client, project))
    batch = {"expected_version": 1, "events": [llm_event(rng), llm_event(rng)]}
    first = client.post(f"/v1/episodes/{mine}/events", json=batch,
                        headers=project.headers("ingest"))
    assert first.status_code == 200, first.text
    positions = first.json()["positions"]

    theirs = start_episode(client, other_project, create_run(client, other_project))
    # The same ids, the same content and other content: both a conflict without a trace.
    for events in (batch["events"], [dict(batch["events"][0], messages=[
            {"role": "user", "content": "other"}])]):
        r = client.post(f"/v1/episodes/{theirs}/events",
                        json={"expected_version": 1, "events": events},
                        headers=other_project.headers("ingest"))
        assert r.status_code == 409, r.text
        err = r.json()["error"]
        assert err["code"] == "idempotency_conflict"
        assert "position" not in err and "stream_id" not in err
        text = json.dumps(r.json())
        assert mine not in text and project.name not in text
        assert "position" not in err["message"]
    assert api_store.stream_version(theirs) == 1  # nothing written
    # A run created with another project's event id: the same conflict.
    started = str(api_store.read_stream(mine)[0].event.event_id)
    r = client.post("/v1/runs", json={"run_id": "run-squat", "event_id": started,
                                      "config": {}}, headers=other_project.headers("ingest"))
    assert r.status_code == 409, r.text
    assert "position" not in r.json()["error"] and mine not in r.text

    # The owner's retry is still an idempotent retry, with its positions.
    again = client.post(f"/v1/episodes/{mine}/events", json=batch,
                        headers=project.headers("ingest"))
    assert again.status_code == 200, again.text
    assert again.json()["duplicate"] is True and again.json()["positions"] == positions
    # The owner changing an event's content: a conflict naming its own event's position.
    changed = dict(batch["events"][0], messages=[{"role": "user", "content": "changed"}])
    r = client.post(f"/v1/episodes/{mine}/events",
                    json={"expected_version": 3, "events": [changed]},
                    headers=project.headers("ingest"))
    assert r.status_code == 409 and r.json()["error"]["position"] == positions[0]
