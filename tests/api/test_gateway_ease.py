"""The gateway as agent code uses it: run and episode created on the first call, the real
``openai`` client on a base URL, reward and finish routes, ``/v1/models``, and the Python
client. The in-process engine is the tiny model."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from store.eventlog import EventStore
from tests.api.conftest import Project
from trajstore.client import TrajstoreClient, TrajstoreError
from workers.replay.jobs.project import project_episode

pytestmark = pytest.mark.timeout(600)

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


def _types(store: EventStore, stream: str) -> list[str]:
    return [r.type for r in store.read_stream(stream)]


def test_the_openai_client_on_a_base_url_creates_run_and_episode(
        gateway: TestClient, api_store: EventStore, project: Project,
        tiny_model_dir: Path) -> None:
    from openai import OpenAI

    ts = TrajstoreClient(str(gateway.base_url), project.ingest, http=gateway)
    run_id = f"agent-{uuid.uuid4().hex[:8]}"
    episode = ts.episode(run_id, group_id="task-7")
    llm = OpenAI(**episode.openai_kwargs, http_client=gateway)
    first = llm.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8)
    assert first.choices[0].message is not None
    messages = [*MESSAGES, {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And 3 + 4?"}]
    llm.chat.completions.create(model="tiny", messages=messages, max_tokens=8)
    run = api_store.get_run(run_id)
    assert run.project == project.name
    assert run.config.tokenizer == str(tiny_model_dir)  # the engine's own tokenizer
    started = api_store.read_stream(episode.episode_id)[0].event
    assert (started.run_id, started.group_id, started.messages) == (run_id, "task-7", MESSAGES)
    assert _types(api_store, episode.episode_id) == [
        "episode_started", "llm_called", "llm_called"]
    # Reward and finish, idempotently; after the finish nothing but a late reward.
    rid = uuid.uuid4()
    assert not episode.reward(0.5, event_id=rid)["duplicate"]
    assert episode.reward(0.5, event_id=rid)["duplicate"]
    done = episode.finish(reward=1.0)
    assert not done["duplicate"]
    again = episode.finish()
    assert again["duplicate"] and again["version"] == done["version"]
    late_reward = episode.reward(0.75)  # no sample consumed: the latest reward wins
    assert not late_reward["duplicate"] and late_reward["version"] == done["version"] + 1
    with pytest.raises(TrajstoreError) as refused:
        episode.reward(True)  # type: ignore[arg-type]
    assert refused.value.status == 422 and refused.value.error["field"] == "body.value"
    late = gateway.post(f"/v1/runs/{run_id}/episodes/{episode.episode_id}/chat/completions",
                        json={"model": "tiny", "messages": MESSAGES, "max_tokens": 4},
                        headers=project.headers("ingest"))
    assert late.status_code == 409
    assert _types(api_store, episode.episode_id)[-4:] == [
        "reward_assigned", "reward_assigned", "episode_finished", "reward_assigned"]
    # The captured episode replays into trainable samples.
    outcome = project_episode(api_store, episode.episode_id)
    assert outcome.outcome == "written" and outcome.status == "completed", outcome


def test_headers_create_an_episode_in_an_existing_run(gateway: TestClient, project: Project,
                                                      api_store: EventStore) -> None:
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    assert gateway.post("/v1/runs", json={"run_id": run_id},
                        headers=project.headers("ingest")).status_code == 201
    episode_id = f"ep-{uuid.uuid4().hex[:8]}"
    r = gateway.post("/v1/chat/completions",
                     json={"model": "tiny", "messages": MESSAGES, "max_tokens": 4},
                     headers={**project.headers("ingest"), "X-Trajstore-Run": run_id,
                              "X-Trajstore-Episode": episode_id})
    assert r.status_code == 200, r.text
    started = api_store.read_stream(episode_id)[0].event
    assert started.run_id == run_id and started.group_id == episode_id


def test_implicit_ids_are_checked_like_explicit_ones(gateway: TestClient, project: Project,
                                                     other_project: Project,
                                                     api_store: EventStore) -> None:
    theirs = f"run-{uuid.uuid4().hex[:8]}"
    assert gateway.post("/v1/runs", json={"run_id": theirs},
                        headers=other_project.headers("ingest")).status_code == 201
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}
    episode_id = f"ep-{uuid.uuid4().hex[:8]}"
    r = gateway.post(f"/v1/runs/{theirs}/episodes/{episode_id}/chat/completions", json=body,
                     headers=project.headers("ingest"))
    assert r.status_code == 403, r.text
    assert api_store.stream_version(episode_id) == 0
    bad = gateway.post("/v1/chat/completions", json=body,
                       headers={**project.headers("ingest"), "X-Trajstore-Run": "a b",
                                "X-Trajstore-Episode": "ep-x"})
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "header.X-Trajstore-Run"
    alone = gateway.post("/v1/chat/completions", json=body,
                         headers={**project.headers("ingest"), "X-Trajstore-Run": "r1"})
    assert alone.status_code == 422
    assert alone.json()["error"]["field"] == "header.X-Trajstore-Episode"
    # An episode that does not exist and names no run is still a 404.
    missing = gateway.post("/v1/chat/completions", json=body,
                           headers={**project.headers("ingest"), "X-Trajstore-Episode": "nope"})
    assert missing.status_code == 404
    # Reward and finish of an unknown or foreign episode.
    assert gateway.post("/v1/episodes/nope/finish", json={},
                        headers=project.headers("ingest")).status_code == 404
    r = gateway.post("/v1/episodes/x/reward", json={"value": "NaN"},
                     headers=project.headers("ingest"))
    assert r.status_code == 422


def test_models_lists_the_engine(gateway: TestClient, project: Project, api_settings: Any
                                 ) -> None:
    r = gateway.get("/v1/models", headers=project.headers("ingest"))
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == [api_settings.gateway_model_name]
    assert gateway.get("/v1/models").status_code == 401


def test_models_on_the_episode_base_url(gateway: TestClient, project: Project,
                                        api_settings: Any, api_store: EventStore) -> None:
    """The real ``openai`` client on the per-episode base URL the docs give lists and
    retrieves the gateway's model; asking creates no run and no episode."""
    import openai
    from openai import OpenAI

    ts = TrajstoreClient(str(gateway.base_url), project.ingest, http=gateway)
    run_id = f"agent-{uuid.uuid4().hex[:8]}"
    episode = ts.episode(run_id)
    llm = OpenAI(**episode.openai_kwargs, http_client=gateway)
    assert [m.id for m in llm.models.list()] == [api_settings.gateway_model_name]
    assert llm.models.retrieve(api_settings.gateway_model_name).id == \
        api_settings.gateway_model_name
    with pytest.raises(openai.NotFoundError):
        llm.models.retrieve("no-such-model")
    plain = OpenAI(base_url=f"{gateway.base_url}/v1", api_key=project.ingest,
                   http_client=gateway)
    assert [m.id for m in plain.models.list()] == [api_settings.gateway_model_name]
    assert api_store.read_stream(episode.episode_id) == []
