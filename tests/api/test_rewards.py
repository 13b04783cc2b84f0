"""Rewards over REST: an episode recorded without one waits (``no_reward``: the samples
listing, the run and the episode page say so), a late reward is taken until a sample is
consumed, then refused with 409 naming the samples; bad rewards are 422 naming the field,
an unknown episode 404, and nothing already stored changes."""

from __future__ import annotations

import html
import re
import uuid
from typing import Any

import pytest
from fastapi.testclient import TestClient

from store.eventlog import EventStore
from store.events import Event
from tests.api.conftest import Project
from tests.api.episodes import create_run, episode_events
from workers.replay.jobs.project import project_episode


@pytest.fixture(scope="module")
def qwen3() -> Any:
    from workers.engines.tokenizers import load_tokenizer

    return load_tokenizer("qwen3")


def as_json(event: Event) -> dict[str, Any]:
    """An event as a client posts it: its type, fields and token lists."""
    return {"type": event.type, **event.to_data(),
            **{name: array.tolist() for name, array in event.token_payloads().items()}}


def record_unrewarded(client: TestClient, project: Project, qwen3: Any, run_id: str) -> str:
    """An episode posted as a batch of events (the REST door), finished without a reward."""
    events = [e for e in episode_events(qwen3, run_id=run_id, group_id="g0", a=2, b=3,
                                        reward=0.0, failed_attempt=True)
              if e.type != "reward_assigned"]
    episode = f"ep-{uuid.uuid4().hex[:8]}"
    r = client.post(f"/v1/episodes/{episode}/events", headers=project.headers("ingest"),
                    json={"expected_version": "no_stream",
                          "events": [as_json(e) for e in events]})
    assert r.status_code == 200, r.text
    return episode


def listing(client: TestClient, project: Project, run_id: str) -> list[dict[str, Any]]:
    r = client.get(f"/v1/runs/{run_id}/samples", params={"tokens": "false"},
                   headers=project.headers("read"))
    assert r.status_code == 200, r.text
    return sorted(r.json()["samples"], key=lambda s: s["sample_id"])


def test_a_late_reward_over_rest_until_a_sample_is_consumed(
        client: TestClient, project: Project, api_store: EventStore, qwen3: Any) -> None:
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    create_run(api_store, run_id, project=project.name, group_size=1)
    episode = record_unrewarded(client, project, qwen3, run_id)
    assert project_episode(api_store, episode).outcome == "written"
    waiting = listing(client, project, run_id)
    assert [(s["kind"], s["status"], s["reward"]) for s in waiting] == [
        ("positive", "no_reward", None), ("negative", "no_reward", -1.0)]
    filtered = client.get(f"/v1/runs/{run_id}/samples", headers=project.headers("read"),
                          params={"status": "no_reward", "tokens": "false"})
    assert len(filtered.json()["samples"]) == 2
    run = client.get(f"/v1/runs/{run_id}", headers=project.headers("read")).json()
    assert run["samples"]["no_reward"] == 2 and run["excluded"]["no_reward"] == 1
    page = client.get(f"/ui/episodes/{episode}", headers=project.headers("read"))
    rows = re.search(r'id="exclusion-rows">.*?<tbody>(.*?)</tbody>', page.text, re.S)
    assert rows is not None
    cells = [html.unescape(re.sub(r"<[^>]+>", "", c)).strip()
             for c in re.findall(r"<td[^>]*>(.*?)</td>", rows.group(1), re.S)]
    assert cells[:2] == ["no_reward", "episode"]
    assert client.post(f"/v1/runs/{run_id}/leases", json={"groups": 1},
                       headers=project.headers("train")).status_code == 204

    version = api_store.stream_version(episode)
    late = client.post(f"/v1/episodes/{episode}/reward", json={"value": 0.5},
                       headers=project.headers("ingest"))
    assert late.status_code == 200, late.text
    assert late.json()["version"] == version + 1
    assert project_episode(api_store, episode).outcome == "written"
    assert [(s["status"], s["reward"]) for s in listing(client, project, run_id)] == [
        ("ready", 0.5), ("ready", -1.0)]
    lease = client.post(f"/v1/runs/{run_id}/leases", json={"groups": 1},
                        headers=project.headers("train")).json()
    assert sorted(s["reward"] for s in lease["samples"]) == [-1.0, 0.5]
    leased = client.post(f"/v1/episodes/{episode}/reward", json={"value": 1.0},
                         headers=project.headers("ingest"))
    assert leased.status_code == 409 and leased.json()["error"]["code"] == "samples_leased"
    assert client.post(f"/v1/leases/{lease['lease_id']}/ack", json={"policy_version": 1},
                       headers=project.headers("train")).status_code == 200

    refused = client.post(f"/v1/episodes/{episode}/reward", json={"value": 1.0},
                          headers=project.headers("ingest"))
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["code"] == "samples_consumed"
    ids = sorted(s["sample_id"] for s in lease["samples"])
    assert sorted(s["sample_id"] for s in error["samples"]) == ids
    assert {s["status"] for s in error["samples"]} == {"consumed"}
    assert all(str(i) in error["message"] for i in ids)
    assert api_store.stream_version(episode) == version + 1  # nothing stored
    assert [(s["status"], s["reward"]) for s in listing(client, project, run_id)] == [
        ("consumed", 0.5), ("consumed", -1.0)]


@pytest.mark.parametrize("value, field", [
    ("true", "body.value"),
    ('"0.5"', "body.value"),
    ("1e400", "body.value"),
    ("NaN", "body.value"),
    ("null", "body.value"),
])
def test_a_reward_that_is_no_finite_number_is_422_naming_the_field(
        client: TestClient, project: Project, api_store: EventStore, qwen3: Any,
        value: str, field: str) -> None:
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    create_run(api_store, run_id, project=project.name, group_size=1)
    episode = record_unrewarded(client, project, qwen3, run_id)
    version = api_store.stream_version(episode)
    headers = {**project.headers("ingest"), "Content-Type": "application/json"}
    r = client.post(f"/v1/episodes/{episode}/reward", content=f'{{"value": {value}}}',
                    headers=headers)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["field"] == field
    r = client.post(f"/v1/episodes/{episode}/reward", headers=headers,
                    content=f'{{"value": 0.5, "components": {{"correct": {value}}}}}')
    assert r.status_code == 422 and r.json()["error"]["field"] == "body.components.correct"
    if value != "null":  # a finish without a reward is a finish
        r = client.post(f"/v1/episodes/{episode}/finish", content=f'{{"reward": {value}}}',
                        headers=headers)
        assert r.status_code == 422 and r.json()["error"]["field"] == "body.reward"
    assert api_store.stream_version(episode) == version  # nothing stored


def test_a_reward_for_an_unknown_episode_is_404(client: TestClient, project: Project,
                                                api_store: EventStore) -> None:
    missing = f"ep-{uuid.uuid4().hex[:8]}"
    r = client.post(f"/v1/episodes/{missing}/reward", json={"value": 1.0},
                    headers=project.headers("ingest"))
    assert r.status_code == 404 and missing in r.json()["error"]["message"]
    # Through the batch route too: a stream that is no episode takes no reward.
    r = client.post(f"/v1/episodes/{missing}/events", headers=project.headers("ingest"),
                    json={"expected_version": "any",
                          "events": [{"type": "reward_assigned", "value": 1.0}]})
    assert r.status_code == 404
    assert api_store.stream_version(missing) == 0
