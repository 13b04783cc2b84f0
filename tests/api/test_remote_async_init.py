"""The RolloutServer side of the remote-rollout protocol's asynchronous revision:
``POST /v1/rollout/init`` answers 202 with the tools and queues the rollout; a real rollout
worker process plays it against an independently written trainer
(``tests/rollout/chat_trainer.py``, serving ``/v1/chat/completions`` and taking
``/v1/rollout/completed``) and posts its RolloutResponse back, retried while the trainer
answers 503. Bad input is refused before anything is queued."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.schemas.remote import RolloutCompleted
from store.eventlog import EventStore
from store.events import EpisodeFinished, LLMCalled, ToolReturned
from store.settings import Settings
from tests.api.conftest import Project
from tests.rollout.chat_trainer import ChatTrainer
from tests.rollout.turns import tool_call
from tests.workers.conftest import Worker

pytestmark = pytest.mark.timeout(600)

QUESTION = [{"role": "system", "content": "You are a calculator."},
            {"role": "user", "content": "What is 5 + 3?"}]


@pytest.fixture
def api_settings(tmp_path: Path, pg_url: str, rollout_broker: str) -> Settings:
    return Settings(database_url=pg_url, redis_url=rollout_broker, data_dir=tmp_path,
                    api_key_scrypt_n=1024)


@pytest.fixture
def client(api_settings: Settings, api_store: EventStore, rollout_worker: Worker
           ) -> Iterator[TestClient]:
    with TestClient(create_app(api_settings, store=api_store)) as c:
        yield c


@pytest.fixture(scope="module")
def trainer(tiny_model_dir: Path) -> Iterator[ChatTrainer]:
    from workers.engines.backend_transformers import TransformersBackend

    with ChatTrainer(TransformersBackend(tiny_model_dir)) as server:
        yield server


def new_run(client: TestClient, project: Project, tokenizer: str | None) -> str:
    run_id = f"async-{uuid.uuid4().hex[:8]}"
    config: dict[str, Any] = {"group_size": 1}
    if tokenizer is not None:
        config["tokenizer"] = tokenizer
    r = client.post("/v1/runs", headers=project.headers("ingest"),
                    json={"run_id": run_id, "config": config})
    assert r.status_code == 201, r.text
    return run_id


def init_body(server_url: str, run_id: str, **changes: Any) -> dict[str, Any]:
    """The reference revision's init request (its field names, ``api_key`` and
    ``completion_params``), plus this store's ``run_id``."""
    return {"rollout_id": f"r-{uuid.uuid4().hex[:10]}", "server_url": server_url,
            "api_key": "trainer-secret", "messages": QUESTION,
            "completion_params": {"temperature": 1.0, "top_p": 1.0, "max_tokens": 64,
                                  "stop": None, "logprobs": True},
            "tool_server_url": None, "max_turns": 4, "max_tokens_total": 4096,
            "metadata": {}, "run_id": run_id, **changes}


def test_init_answers_202_with_the_tools_then_plays_and_reports_the_rollout(
        client: TestClient, project: Project, api_store: EventStore, trainer: ChatTrainer,
        tiny_model_dir: Path) -> None:
    run_id = new_run(client, project, str(tiny_model_dir))
    body = init_body(trainer.url, run_id)
    rid = body["rollout_id"]
    trainer.script(rid, [tool_call("calculator", expression="5 + 3"), "It is 8."])
    trainer.refuse_completed = trainer.completed_tries + 2  # two 503s, then taken
    before = trainer.completed_tries

    r = client.post("/v1/rollout/init", headers=project.headers("ingest"), json=body)
    assert r.status_code == 202, r.text
    assert r.json()["rollout_id"] == rid
    assert [t["function"]["name"] for t in r.json()["tools"]] == ["calculator"]

    report = trainer.wait_completed(rid)
    assert trainer.completed_tries - before == 3, "the callback is retried after 503s"
    assert report["status"] == "COMPLETED", report["error_message"]
    assert report["finish_reason"] == "stop"
    final = report["final_messages"]
    assert [m["role"] for m in final] == ["system", "user", "assistant", "tool", "assistant"]
    assert final[3]["content"] == "8" and final[-1]["content"] == "It is 8."
    assert report["metrics"]["num_llm_calls"] == 2
    assert report["metrics"]["num_tool_calls"] == 1
    assert report["extra_fields"]["episode_id"] == f"rollout-{rid}"
    # what this store's own trainer side takes as the completion report
    assert RolloutCompleted.model_validate(report).status == "COMPLETED"

    calls = trainer.calls_of(rid)
    assert [c.path for c in calls] == ["/v1/chat/completions"] * 2
    assert all(c.extends_buffer for c in calls[1:])
    served = [a for p, a in zip(trainer.paths, trainer.authorizations, strict=True)
              if p in ("/v1/chat/completions", "/v1/rollout/completed")]
    assert served and set(served[-5:]) == {"Bearer trainer-secret"}

    events = [e.event for e in api_store.get_episode(f"rollout-{rid}")]
    llm = [e for e in events if isinstance(e, LLMCalled)]
    assert [e.response_ids.tolist() for e in llm] == [c.token_ids for c in calls]
    assert [(t.name, t.output) for t in events if isinstance(t, ToolReturned)] == [
        ("calculator", "8")]
    assert isinstance(events[-1], EpisodeFinished) and events[-1].status == "completed"

    # the same rollout id again: 202, not played twice
    version = api_store.stream_version(f"rollout-{rid}")
    r = client.post("/v1/rollout/init", headers=project.headers("ingest"), json=body)
    assert r.status_code == 202, r.text
    time.sleep(1.0)
    assert len(trainer.calls_of(rid)) == 2
    assert api_store.stream_version(f"rollout-{rid}") == version
    assert [b["rollout_id"] for b in trainer.completed].count(rid) == 1


def test_a_trainer_failure_is_reported_as_error(
        client: TestClient, project: Project, api_store: EventStore, trainer: ChatTrainer,
        tiny_model_dir: Path) -> None:
    """The trainer refuses the first generation (400: it has no script for this rollout):
    the report says ERROR, the trainer unreachable (a first call's failure says nothing
    about what answered), and the episode ends ``error``."""
    run_id = new_run(client, project, str(tiny_model_dir))
    body = init_body(trainer.url, run_id)
    rid = body["rollout_id"]
    r = client.post("/v1/rollout/init", headers=project.headers("ingest"), json=body)
    assert r.status_code == 202, r.text
    report = trainer.wait_completed(rid)
    assert report["status"] == "ERROR"
    assert "unreachable" in report["error_message"] and "400" not in report["error_message"]
    events = [e.event for e in api_store.get_episode(f"rollout-{rid}")]
    assert isinstance(events[-1], EpisodeFinished) and events[-1].status == "error"


@pytest.mark.parametrize("change,field", [
    ({"rollout_id": None}, "rollout_id"),
    ({"rollout_id": "  "}, "rollout_id"),
    ({"messages": []}, "messages"),
    ({"completion_params": {"temperature": 5}}, "completion_params"),
    ({"completion_params": {"beam_width": 2}}, "completion_params"),
    ({"api_key": 7}, "api_key"),
    ({"max_turns": 0}, "max_turns"),
    ({"metadata": [1]}, "metadata"),
    ({"tokenizer_name": "qwen3"}, "tokenizer_name"),
    ({"server_url": "ftp://trainer"}, "server_url"),
    ({"server_url": "http://203.0.113.7:8000"}, "server_url"),
    ({"rollout_id": "bad\u0000id"}, "rollout_id"),
])
def test_bad_input_is_422_naming_the_field_and_nothing_runs(
        client: TestClient, project: Project, api_store: EventStore, trainer: ChatTrainer,
        tiny_model_dir: Path, change: dict[str, Any], field: str) -> None:
    run_id = new_run(client, project, str(tiny_model_dir))
    body = init_body(trainer.url, run_id) | change
    if body["rollout_id"] is None:
        del body["rollout_id"]
    r = client.post("/v1/rollout/init", headers=project.headers("ingest"), json=body)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert field in (error.get("field") or "") + error["message"], error
    rid = body.get("rollout_id")
    if isinstance(rid, str) and "\x00" not in rid:
        assert api_store.read_stream(f"rollout-{rid}") == []


def test_a_run_without_tokenizer_another_project_and_no_key_are_refused(
        client: TestClient, project: Project, other_project: Project, api_store: EventStore,
        trainer: ChatTrainer, tiny_model_dir: Path) -> None:
    bare = new_run(client, project, None)
    body = init_body(trainer.url, bare)
    r = client.post("/v1/rollout/init", headers=project.headers("ingest"), json=body)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["field"] == "body.run_id"
    assert "tokenizer" in r.json()["error"]["message"]

    theirs = new_run(client, other_project, str(tiny_model_dir))
    r = client.post("/v1/rollout/init", headers=project.headers("ingest"),
                    json=init_body(trainer.url, theirs))
    assert r.status_code == 403, r.text
    r = client.post("/v1/rollout/init", headers=project.headers("read"),
                    json=init_body(trainer.url, bare))
    assert r.status_code == 403, r.text
    r = client.post("/v1/rollout/init", json=init_body(trainer.url, bare))
    assert r.status_code == 401, r.text
    r = client.post("/v1/rollout/init", headers=project.headers("ingest"),
                    json=init_body(trainer.url, "no-such-run"))
    assert r.status_code == 404, r.text
    assert api_store.read_stream(f"rollout-{body['rollout_id']}") == []


def test_the_callback_is_not_retried_on_a_final_answer_and_checks_its_arguments() -> None:
    """401 is final (one try); 503 is retried up to ``attempts``; the callback URL drops a
    completions path that ``server_url`` ends with."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from tests.servers import ThreadedServer
    from workers.rollout.remote import completion_url, post_rollout_completed

    tries: dict[str, int] = {}
    app = FastAPI()

    @app.post("/{kind}/v1/rollout/completed")
    def completed(kind: str) -> JSONResponse:
        tries[kind] = tries.get(kind, 0) + 1
        if kind == "flaky":  # two failures, then taken
            return JSONResponse({}, status_code=200 if tries[kind] == 3 else 502)
        return JSONResponse({}, status_code=401 if kind == "final" else 503)

    server = ThreadedServer(app, lifespan="off")
    server.start()
    try:
        report = {"rollout_id": "r1", "status": "COMPLETED"}
        assert post_rollout_completed(f"{server.url}/final/v1/chat/completions", report,
                                      api_key=None, attempts=4, backoff_s=0) == 401
        assert post_rollout_completed(f"{server.url}/busy", report, api_key="k",
                                      attempts=3, backoff_s=0) == 503
        assert post_rollout_completed(f"{server.url}/flaky", report, api_key=None,
                                      attempts=5, backoff_s=0.01) == 200
    finally:
        server.stop()
    assert tries == {"final": 1, "busy": 3, "flaky": 3}
    # Nobody listening: every try fails to connect, and nothing answered.
    assert post_rollout_completed(server.url, {"rollout_id": "r2"}, api_key=None, attempts=2,
                                  backoff_s=0) is None
    assert completion_url("http://t:1/v1/completions/") == "http://t:1/v1/rollout/completed"
    with pytest.raises(ValueError, match="attempts"):
        post_rollout_completed("http://127.0.0.1:9", {}, api_key=None, attempts=0)
    with pytest.raises(ValueError, match="backoff_s"):
        post_rollout_completed("http://127.0.0.1:9", {}, api_key=None, backoff_s=-1)
