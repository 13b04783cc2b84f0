"""The trainer side of the remote-rollout protocol across its revisions, with the tiny model
as the in-process engine: a revision without masks is not reported ``mask_missing``, the
asynchronous completion's reward is recorded wherever the report carries it, synchronous
rollouts (which never report their end) are finished by the idle timeout, and a
``tokenizer_name`` the run cannot replay is refused."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from store.eventlog import EventStore
from store.events import EpisodeFinished, LLMCalled
from store.settings import Settings
from tests.api.conftest import Project
from tests.workers.conftest import Worker
from workers.replay.jobs.project import project_episode
from workers.replay.jobs.sweep import finish_idle_rollouts

pytestmark = pytest.mark.timeout(600)

QUESTION = [{"role": "system", "content": "You are a calculator."},
            {"role": "user", "content": "What is 5 + 3?"}]


@pytest.fixture
def gateway(api_settings: Settings, api_store: EventStore, tiny_model_dir: Path,
            rollout_broker: str) -> Iterator[TestClient]:
    settings = api_settings.model_copy(update={"gateway_engine_model": str(tiny_model_dir),
                                               "gateway_max_tokens": 16,
                                               "redis_url": rollout_broker})
    with TestClient(create_app(settings, store=api_store)) as c:
        yield c


def new_rollout(client: TestClient, project: Project, tokenizer: str) -> tuple[str, str]:
    run_id = f"remote-{uuid.uuid4().hex[:8]}"
    r = client.post("/v1/runs", headers=project.headers("ingest"), json={
        "run_id": run_id, "config": {"group_size": 1, "tokenizer": tokenizer}})
    assert r.status_code == 201, r.text
    rollout_id = f"rollout-{uuid.uuid4().hex[:10]}"
    r = client.post(f"/v1/runs/{run_id}/episodes", headers=project.headers("ingest"),
                    json={"episode_id": rollout_id, "group_id": "g0", "messages": QUESTION})
    assert r.status_code == 201, r.text
    return run_id, rollout_id


def call(client: TestClient, project: Project, rollout_id: str,
         messages: list[dict[str, Any]], **mask: Any) -> dict[str, Any]:
    # A seeded draw whose text re-encodes to the same ids: the tiny model's byte tokens
    # can decode to text that does not (a prefix mismatch no revision could avoid).
    r = client.post("/v1/chat/completions", headers=project.headers("ingest"), json={
        "model": "default", "rollout_id": rollout_id, "messages": messages,
        "temperature": 1.0, "max_tokens": 4, "seed": 5, **mask})
    assert r.status_code == 200, r.text
    return dict(r.json())


def conversation(client: TestClient, project: Project, rollout_id: str, **mask: Any
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    first = call(client, project, rollout_id, QUESTION, **mask)
    messages = [*QUESTION, first["choices"][0]["message"],
                {"role": "user", "content": "And 2 + 2?"}]
    return first, call(client, project, rollout_id, messages, **mask)


def test_a_revision_without_masks_is_not_reported_mask_missing(
        gateway: TestClient, project: Project, tiny_model_dir: Path) -> None:
    _, rollout_id = new_rollout(gateway, project, str(tiny_model_dir))
    first, second = conversation(gateway, project, rollout_id)  # no response_mask key
    assert first["mask_check"]["status"] == "first_call"
    assert second["mask_check"]["status"] == "ok", second["mask_check"]
    assert second["mask_check"]["reasons"] == [] and second["mask_check"]["new_tokens"] > 0
    # The masked revision's explicit null after the first call still is mask_missing.
    _, rollout_id = new_rollout(gateway, project, str(tiny_model_dir))
    _, second = conversation(gateway, project, rollout_id, response_mask=None)
    assert second["mask_check"]["reasons"] == ["mask_missing"]


@pytest.mark.parametrize("report", [
    {"reward": 0.75},
    {"extra_fields": {"reward": 0.75}},
    {"extra_fields": {"reward_extra_info": {"reward": 0.75, "turn_penalty": 0.1}}},
    {"reward_score": 0.75},
    {"metrics": {"reward": 0.75, "num_llm_calls": 2}},
])
def test_the_async_completion_reward_reaches_the_samples(
        gateway: TestClient, project: Project, api_store: EventStore, tiny_model_dir: Path,
        report: dict[str, Any]) -> None:
    run_id, rollout_id = new_rollout(gateway, project, str(tiny_model_dir))
    conversation(gateway, project, rollout_id)
    done = gateway.post("/v1/rollout/completed", headers=project.headers("ingest"), json={
        "rollout_id": rollout_id, "status": "COMPLETED", "finish_reason": "stop",
        "final_messages": QUESTION, **report})
    assert done.status_code == 200, done.text
    assert done.json()["reward"] == 0.75
    assert project_episode(api_store, rollout_id).outcome == "written"
    samples = gateway.get(f"/v1/runs/{run_id}/samples", params={"tokens": "false"},
                          headers=project.headers("read")).json()["samples"]
    assert samples and {s["reward"] for s in samples} == {0.75}


def test_the_async_completion_without_a_reward_waits_for_a_later_report(
        gateway: TestClient, project: Project, api_store: EventStore,
        tiny_model_dir: Path) -> None:
    """The asynchronous revision's completion carries no reward: the episode is finished
    and waits (no_reward); a later report (or POST /v1/episodes/{id}/reward) brings it, the
    latest one wins, and a retried report is stored once."""
    run_id, rollout_id = new_rollout(gateway, project, str(tiny_model_dir))
    conversation(gateway, project, rollout_id)
    report = {"rollout_id": rollout_id, "status": "COMPLETED", "finish_reason": "stop",
              "final_messages": QUESTION}
    headers = project.headers("ingest")
    done = gateway.post("/v1/rollout/completed", headers=headers, json=report)
    assert done.status_code == 200 and done.json()["reward"] is None
    assert project_episode(api_store, rollout_id).outcome == "written"

    def samples() -> list[tuple[str, float | None]]:
        got = gateway.get(f"/v1/runs/{run_id}/samples", params={"tokens": "false"},
                          headers=project.headers("read")).json()["samples"]
        return [(s["status"], s["reward"]) for s in got]

    assert samples() == [("no_reward", None)]
    assert gateway.post("/v1/rollout/completed", headers=headers,
                        json=report).json()["duplicate"] is True
    scored = gateway.post("/v1/rollout/completed", headers=headers,
                          json={**report, "status": "COMPLETED", "reward": 0.25})
    assert scored.status_code == 200, scored.text
    assert (scored.json()["status"], scored.json()["reward"]) == ("completed", 0.25)
    assert scored.json()["duplicate"] is False
    again = gateway.post("/v1/rollout/completed", headers=headers, json={**report, "reward": 0.25})
    assert again.json()["duplicate"] is True
    rescored = gateway.post("/v1/rollout/completed", headers=headers,
                            json={**report, "extra_fields": {"reward": 0.5}})
    assert rescored.status_code == 200 and rescored.json()["reward"] == 0.5
    assert project_episode(api_store, rollout_id).outcome == "written"
    assert samples() == [("ready", 0.5)]
    rewards = [r.event.value for r in api_store.read_stream(rollout_id)
               if r.type == "reward_assigned"]
    assert rewards == [0.25, 0.5]  # both in the log, the latest is the episode's
    bad = gateway.post("/v1/rollout/completed", headers=headers, json={**report, "reward": True})
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "body.reward"


def test_idle_synchronous_rollouts_are_finished_and_yield_samples(
        gateway: TestClient, project: Project, api_store: EventStore,
        tiny_model_dir: Path) -> None:
    run_id, rollout_id = new_rollout(gateway, project, str(tiny_model_dir))
    _, last = conversation(gateway, project, rollout_id)
    assert not last["choices"][0]["message"].get("tool_calls")
    # A gateway episode (no remote-rollout call) is not a rollout: left to the stale sweep.
    plain = f"ep-{uuid.uuid4().hex[:8]}"
    r = gateway.post(f"/v1/runs/{run_id}/episodes/{plain}/chat/completions",
                     headers=project.headers("ingest"),
                     json={"messages": QUESTION, "max_tokens": 4})
    assert r.status_code == 200, r.text
    now = dt.datetime.now(dt.UTC)
    assert finish_idle_rollouts(api_store, timeout_s=600, now=now) == 0  # not idle yet
    later = now + dt.timedelta(seconds=601)
    finished = finish_idle_rollouts(api_store, timeout_s=600, now=later)
    assert finished >= 1
    events = [r.event for r in api_store.read_stream(rollout_id)]
    end = events[-1]
    assert isinstance(end, EpisodeFinished) and end.status == "completed"
    assert "idle" in (end.reason or "")
    assert not any(isinstance(r.event, EpisodeFinished) for r in api_store.read_stream(plain))
    assert finish_idle_rollouts(api_store, timeout_s=600, now=later) == 0  # once
    # The rollout replays into samples; later calls are refused.
    assert project_episode(api_store, rollout_id).outcome == "written"
    samples = gateway.get(f"/v1/runs/{run_id}/samples", params={"tokens": "false"},
                          headers=project.headers("read")).json()["samples"]
    assert [s["episode_id"] for s in samples] == [rollout_id]
    again = gateway.post("/v1/chat/completions", headers=project.headers("ingest"), json={
        "rollout_id": rollout_id, "messages": QUESTION, "max_tokens": 4})
    assert again.status_code == 409
    assert sum(isinstance(r.event, LLMCalled) for r in api_store.read_stream(rollout_id)) == 2


def test_a_tokenizer_name_the_run_cannot_replay_is_refused(
        gateway: TestClient, project: Project, api_store: EventStore,
        tiny_model_dir: Path) -> None:
    run_id, _ = new_rollout(gateway, project, str(tiny_model_dir))
    rollout_id = f"r-{uuid.uuid4().hex[:8]}"
    r = gateway.post("/rollout", headers=project.headers("ingest"), json={
        "rollout_id": rollout_id, "server_url": "http://127.0.0.1:9",
        "messages": QUESTION, "tokenizer_name": "Qwen/Qwen3-8B", "run_id": run_id})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["field"] == "body.tokenizer_name"
    assert "Qwen/Qwen3-8B" in error["message"] and str(tiny_model_dir) in error["message"]
    assert api_store.read_stream(f"rollout-{rollout_id}") == []


def test_rollout_route_accepts_the_reference_request_and_plays_a_chat_only_trainer(
        gateway: TestClient, project: Project, api_store: EventStore,
        tiny_model_dir: Path, rollout_worker: Worker) -> None:
    """``POST /rollout`` with the reference revision's body (``metadata``,
    ``tool_server_url``) against a trainer serving only ``/v1/chat/completions`` that returns
    tool calls outside its token ids, played by a real rollout worker process."""
    from tests.rollout.chat_trainer import ChatTrainer
    from tests.rollout.turns import tool_call
    from workers.engines.backend_transformers import TransformersBackend

    run_id, _ = new_rollout(gateway, project, str(tiny_model_dir))
    body = {"rollout_id": f"r-{uuid.uuid4().hex[:8]}", "messages": QUESTION,
            "sampling_params": {"temperature": 1.0, "top_p": 1.0, "max_tokens": 64,
                                "stop": None, "logprobs": True},
            "tokenizer_name": str(tiny_model_dir), "tokenizer_revision": "main",
            "max_turns": 4, "max_tokens_total": 4096, "callback_api_key": None,
            "metadata": {"max_assistant_turns": 4}, "tool_server_url": None,
            "run_id": run_id}
    for field, value, code in (("metadata", [1], 422), ("tool_server_url", 5, 422),
                               ("vendor_field", 1, 422)):
        r = gateway.post("/rollout", headers=project.headers("ingest"),
                         json=body | {"server_url": "http://127.0.0.1:9", field: value})
        assert r.status_code == code, r.text
        assert field in (r.json()["error"].get("field") or "") + r.json()["error"]["message"]
    assert api_store.read_stream(f"rollout-{body['rollout_id']}") == []

    with ChatTrainer(TransformersBackend(tiny_model_dir)) as trainer:
        trainer.script(body["rollout_id"], [tool_call("calculator", expression="5 + 3"),
                                            "It is 8."])
        r = gateway.post("/rollout", headers=project.headers("ingest"),
                         json=body | {"server_url": trainer.url})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["status"] == "COMPLETED", answer["error_message"]
    assert answer["metrics"]["trainer_endpoint"] == "/v1/chat/completions"
    assert answer["metrics"]["tool_calls"] == 1
    assert answer["metrics"]["tool_calls_outside_ids"] == 1
    tool = answer["final_messages"][-2]
    assert (tool["role"], tool["content"]) == ("tool", "8")
    assert tool["tool_call_id"] == answer["final_messages"][-3]["tool_calls"][0]["id"]
    assert [c.path for c in trainer.calls] == ["/v1/chat/completions"] * 2


def test_rollout_route_checks_before_queueing_and_times_out_naming_the_rollout(
        api_settings: Settings, api_store: EventStore, project: Project,
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """``POST /rollout`` refuses bad input before anything is queued; with no rollout worker
    listening it answers 504 naming the rollout id after ``rollout_wait_s``, and the same
    rollout id, still queued, is 409."""
    from store import embedded
    from workers.queues import queue_depths

    broker = embedded.redis_url(Settings(data_dir=tmp_path / "idle-broker"))
    settings = api_settings.model_copy(update={"redis_url": broker, "rollout_wait_s": 1.0})
    with TestClient(create_app(settings, store=api_store)) as client:
        run_id, _ = new_rollout(client, project, str(tiny_model_dir))
        body = {"rollout_id": f"r-{uuid.uuid4().hex[:8]}", "server_url": "http://127.0.0.1:9",
                "messages": QUESTION, "tokenizer_name": str(tiny_model_dir), "run_id": run_id}
        headers = project.headers("ingest")
        for change, field in (({"max_turns": 0}, "max_turns"),
                              ({"server_url": "http://203.0.113.7:9"}, "server_url"),
                              ({"tokenizer_name": "no/such-tokenizer"}, "tokenizer_name")):
            r = client.post("/rollout", headers=headers, json=body | change)
            assert r.status_code == 422, r.text
            assert field in str(r.json()["error"]), r.text
        assert queue_depths(settings)["rollout"] == 0

        r = client.post("/rollout", headers=headers, json=body)
        assert r.status_code == 504, r.text
        error = r.json()["error"]
        assert error["code"] == "timeout" and body["rollout_id"] in error["message"]
        assert queue_depths(settings)["rollout"] == 1
        again = client.post("/rollout", headers=headers, json=body)
        assert again.status_code == 409, again.text
        assert queue_depths(settings)["rollout"] == 1


def test_both_rollout_routes_answer_503_when_the_broker_is_down(
        api_settings: Settings, api_store: EventStore, project: Project,
        tiny_model_dir: Path) -> None:
    """A valid request with no broker to queue it on: 503 naming the broker, nothing
    recorded."""
    settings = api_settings.model_copy(update={"redis_url": "redis://127.0.0.1:1/0"})
    with TestClient(create_app(settings, store=api_store)) as client:
        run_id, _ = new_rollout(client, project, str(tiny_model_dir))
        rid = f"r-{uuid.uuid4().hex[:8]}"
        headers = project.headers("ingest")
        for path, body in (
                ("/rollout", {"tokenizer_name": str(tiny_model_dir)}),
                ("/v1/rollout/init", {})):
            r = client.post(path, headers=headers, json={
                "rollout_id": rid, "server_url": "http://127.0.0.1:9", "messages": QUESTION,
                "run_id": run_id, **body})
            assert r.status_code == 503, (path, r.text)
            error = r.json()["error"]
            assert error["code"] == "unavailable" and "redis://127.0.0.1:1/0" in error["message"]
        assert api_store.read_stream(f"rollout-{rid}") == []
