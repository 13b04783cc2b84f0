"""The way out for a log written before NUL was refused: a stored row whose JSON holds a
``\\u0000`` escape (events are immutable, so it stays) does not break the listings.

These rows go into a database of this module's own, so that no other test meets them."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from store import migrate
from store.eventlog import EventStore
from tests.api.conftest import Project
from tests.api.test_ingest import create_run, start_episode


@pytest.fixture(scope="module")
def pg_url(pg_server: object) -> Iterator[str]:
    url = pg_server.create_database()  # type: ignore[attr-defined]
    migrate.upgrade(url)
    yield url
    pg_server.drop_database(url)  # type: ignore[attr-defined]


def store_row_with_nul(store: EventStore, stream_id: str, type_name: str, run_id: str,
                       data: str, group_id: str | None = None) -> None:
    """Write a row as an older version of the store could (its JSON holding a \\u0000
    escape), straight into the log: appends refuse it now."""
    with store.db.transaction() as conn:
        conn.execute(
            "INSERT INTO events (event_id, stream_id, stream_version, type, schema_version,"
            " run_id, group_id, data, occurred_at)"
            " VALUES (%s, %s, (SELECT coalesce(max(stream_version), 0) + 1 FROM events"
            "  WHERE stream_id = %s), %s, 1, %s, %s, %s::json, now())",
            (uuid.uuid4(), stream_id, stream_id, type_name, run_id, group_id, data))


def test_a_stored_nul_row_does_not_break_listings(client: TestClient, api_store: EventStore,
                                                  project: Project) -> None:
    good_run = create_run(client, project)
    good_episode = start_episode(client, project, good_run)
    bad_run = f"bad-{uuid.uuid4().hex[:8]}"
    store_row_with_nul(api_store, f"run-{bad_run}", "run_created", bad_run,
                       json.dumps({"run_id": bad_run, "project": project.name,
                                   "config": {"chat_template": "x\u0000"}}))
    bad_episode = f"ep-{uuid.uuid4().hex[:8]}"
    store_row_with_nul(api_store, bad_episode, "episode_started", good_run,
                       json.dumps({"run_id": good_run, "group_id": "g0", "task_id": "t\u0000"}),
                       group_id="g0")
    store_row_with_nul(api_store, bad_episode, "tool_returned", good_run,
                       json.dumps({"name": "t\u0000", "error_type": "E\u0000"}), group_id="g0")

    read = project.headers("read")
    runs = client.get("/v1/runs", headers=read)
    assert runs.status_code == 200, runs.text
    assert {good_run, bad_run} <= {r["run_id"] for r in runs.json()["runs"]}
    listing = client.get("/v1/episodes", params={"run_id": good_run}, headers=read)
    assert listing.status_code == 200, listing.text
    by_id = {e["episode_id"]: e for e in listing.json()["episodes"]}
    assert {good_episode, bad_episode} <= set(by_id)
    assert by_id[bad_episode]["task_id"] == "t\ufffd"
    for params in ({"tool_name": "t"}, {"error_type": "E"}):
        r = client.get("/v1/episodes", params={"run_id": good_run, **params}, headers=read)
        assert r.status_code == 200, r.text
    client.cookies.set("trajstore_key", project.read, path="/ui")
    page = client.get("/ui")
    assert page.status_code == 200 and bad_run in page.text
    assert client.get(f"/v1/runs/{good_run}", headers=read).status_code == 200
    assert client.get(f"/v1/runs/{bad_run}", headers=read).status_code == 200
    detail = client.get(f"/v1/episodes/{bad_episode}", headers=read)
    assert detail.status_code == 200, detail.text
    assert [e["data"].get("name") for e in detail.json()["events"]] == [None, "t\ufffd"]

    # Replay reads the rows the same way: the episode projects instead of failing on the
    # NUL, and its listing keeps answering.
    from store.events import EpisodeFinished
    from workers.replay.jobs.project import project_episode

    api_store.append(bad_episode, [EpisodeFinished(status="completed")])
    outcome = project_episode(api_store, bad_episode)
    assert outcome is not None
    listing = client.get("/v1/episodes", params={"run_id": good_run}, headers=read)
    assert listing.status_code == 200, listing.text
    (row,) = [e for e in listing.json()["episodes"] if e["episode_id"] == bad_episode]
    assert row["projected_version"] == 3
