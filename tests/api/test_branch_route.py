"""``POST /v1/episodes/{id}/branches`` refuses what is not recorded before anything is queued:
an unknown episode or turn or checkpoint is 404 naming it, ``n`` out of range and a bad
choice of turn/checkpoint are 422 naming the field; the listing filters by parent."""

from __future__ import annotations

import uuid

import numpy as np
from fastapi.testclient import TestClient

from store.eventlog import NO_STREAM, EventStore, run_stream_id
from store.events import EpisodeStarted, LLMCalled, RunConfig, RunCreated
from tests.api.conftest import Project


def parent(store: EventStore, project: Project) -> str:
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    store.append(run_stream_id(run_id), [RunCreated(run_id=run_id, project=project.name,
                                                    config=RunConfig(group_size=2))], NO_STREAM)
    episode = f"ep-{uuid.uuid4().hex[:8]}"
    store.append(episode, [
        EpisodeStarted(run_id=run_id, group_id="g",
                       messages=[{"role": "user", "content": "hi"}]),
        LLMCalled(call_id="call_1", messages=[{"role": "user", "content": "hi"}],
                  prompt_ids=np.array([1, 2]), response_ids=np.array([3]),
                  logprobs=np.array([-0.5]), response={"role": "assistant", "content": "x"})],
        NO_STREAM)
    return episode


def test_branch_refusals(client: TestClient, api_store: EventStore, project: Project) -> None:
    episode = parent(api_store, project)
    headers = project.headers("ingest")

    def post(target: str, body: dict) -> tuple[int, dict]:
        answer = client.post(f"/v1/episodes/{target}/branches", json=body, headers=headers)
        return answer.status_code, answer.json()

    status, body = post(episode, {"turn": 2})
    assert status == 404 and "no turn 2" in body["error"]["message"]
    assert body["error"]["field"] == "body.turn"
    status, body = post(episode, {"checkpoint": "ckpt_1_0"})
    assert status == 404 and "no checkpoint 'ckpt_1_0'" in body["error"]["message"]
    status, body = post("ep-missing", {"turn": 0})
    assert status == 404 and "ep-missing" in body["error"]["message"]
    for n in (0, 257):
        status, body = post(episode, {"turn": 1, "n": n})
        assert status == 422 and "n" in str(body["error"].get("field")), body
    status, body = post(episode, {"turn": 1, "checkpoint": "ckpt_1_0"})
    assert status == 422 and body["error"]["field"] == "body.turn"
    listed = client.get("/v1/episodes", params={"branched_from": episode},
                        headers=project.headers("read")).json()
    assert listed["episodes"] == []
