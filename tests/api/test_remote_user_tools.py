"""This store as the RolloutServer with the user's tools, end to end: a real ``trajstore
serve`` process, a real rollout worker process, PostgreSQL and Redis, and a trainer written
from the protocol's wire contract (``tests/rollout/chat_trainer.py``). The reference mock
trainer's ``add``/``multiply`` calls run the user's functions (a run's tool module), the
tools of an MCP server (the request's ``tool_server_url``) run through JSON-RPC, ``GET
/tools`` lists them as the reference does, the reference's metrics are reported, a call on
the last allowed turn runs, an unknown tool is a recorded ``ToolNotFoundError``, and a module
that cannot be imported or a name clash is refused when the run is created."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from store.eventlog import EventStore
from store.events import EpisodeFinished, ToolReturned
from tests.api.conftest import Project, Server
from tests.rollout.chat_trainer import ChatTrainer
from tests.rollout.mcp_server import McpServer
from tests.rollout.turns import tool_call
from tests.workers.conftest import Worker

pytestmark = pytest.mark.timeout(600)

QUESTION = [{"role": "system", "content": "You are a calculator."},
            {"role": "user", "content": "What is (5 + 3) * 2?"}]

#: The user's tools, as a team writes them: plain functions with hints and docstrings.
CALCULATOR = '''
import asyncio


async def add(a: float, b: float) -> float:
    """Add two numbers.

    Args:
        a: First number
        b: Second number
    """
    await asyncio.sleep(0.01)
    return a + b


def multiply(a: float, b: float) -> float:
    """Multiply two numbers.

    Args:
        a: First number
        b: Second number
    """
    return a * b
'''


@pytest.fixture(scope="module")
def trainer(tiny_model_dir: Path) -> Iterator[ChatTrainer]:
    from workers.engines.backend_transformers import TransformersBackend

    with ChatTrainer(TransformersBackend(tiny_model_dir)) as server:
        yield server


@pytest.fixture
def server(start_server: Callable[..., Server], rollout_broker: str,
           rollout_worker: Worker) -> Server:
    return start_server(TRAJSTORE_REDIS_URL=rollout_broker)


@pytest.fixture
def http(server: Server, project: Project) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=300, headers=project.headers("ingest")) as c:
        yield c


def new_run(http: httpx.Client, tiny_model_dir: Path, **rollout: Any) -> str:
    run_id = f"tools-{uuid.uuid4().hex[:8]}"
    r = http.post("/v1/runs", json={"run_id": run_id, "config": {
        "group_size": 1, "tokenizer": str(tiny_model_dir), "rollout": rollout}})
    assert r.status_code == 201, r.text
    return run_id


def request(trainer: ChatTrainer, run_id: str, *, tokenizer_name: str, **changes: Any
            ) -> dict[str, Any]:
    return {"rollout_id": f"t-{uuid.uuid4().hex[:10]}", "server_url": trainer.url,
            "messages": QUESTION, "callback_api_key": "trainer-secret",
            "sampling_params": {"temperature": 1.0, "top_p": 1.0, "max_tokens": 64,
                                "logprobs": True},
            "tokenizer_name": tokenizer_name, "max_turns": 4, "max_tokens_total": 4096,
            "run_id": run_id, **changes}


def tool_results(store: EventStore, episode_id: str) -> list[tuple[str, str, str | None]]:
    return [(e.name, e.output, e.error_type) for e in
            (r.event for r in store.read_stream(episode_id)) if isinstance(e, ToolReturned)]


def finish_with_reward(http: httpx.Client, store: EventStore, episode_id: str,
                       status: str, read: dict[str, str]) -> None:
    """The trainer scores the final messages and posts the reward: the episode is finished
    with its status and reward, and its samples are ready for replay."""
    r = http.post(f"/v1/episodes/{episode_id}/reward", json={"value": 1.0})
    assert r.status_code in (200, 201), r.text
    events = [r.event for r in store.read_stream(episode_id)]
    finished = [e for e in events if isinstance(e, EpisodeFinished)]
    assert len(finished) == 1 and finished[0].status == status
    r = http.get(f"/v1/episodes/{episode_id}", headers=read)
    assert r.status_code == 200, r.text
    episode = r.json()["summary"]
    assert episode["status"] == status and episode["reward"] == 1.0, episode


def test_the_users_tools_run_in_rollouts_and_are_listed(
        http: httpx.Client, trainer: ChatTrainer, tiny_model_dir: Path,
        api_store: EventStore, tmp_path: Path, project: Project) -> None:
    module = tmp_path / "calculator_tools.py"
    module.write_text(CALCULATOR)
    run_id = new_run(http, tiny_model_dir, tool_modules=[str(module)])

    # GET /tools as the reference serves it: the server's own (the calculator) and the run's
    r = http.get("/tools")
    assert r.status_code == 200, r.text
    assert [t["function"]["name"] for t in r.json()["tools"]] == ["calculator"]
    r = http.get("/tools", params={"run_id": run_id})
    assert r.status_code == 200, r.text
    tools = r.json()["tools"]
    assert [t["function"]["name"] for t in tools] == ["add", "multiply"]
    assert tools[0] == {"type": "function", "function": {
        "name": "add", "description": "Add two numbers.",
        "parameters": {"type": "object", "required": ["a", "b"], "properties": {
            "a": {"type": "number", "description": "First number"},
            "b": {"type": "number", "description": "Second number"}}}}}

    # the reference mock trainer's add/multiply calls, and a tool nobody offers
    body = request(trainer, run_id, tokenizer_name=str(tiny_model_dir))
    rid = body["rollout_id"]
    trainer.script(rid, [tool_call("add", a=5, b=3), tool_call("multiply", a=8, b=2),
                         tool_call("subtract", a=16, b=1), "It is 16."])
    r = http.post("/rollout", json=body)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["status"] == "COMPLETED", answer["error_message"]
    assert answer["finish_reason"] == "stop"
    tool_messages = [m["content"] for m in answer["final_messages"] if m["role"] == "tool"]
    assert tool_messages[:2] == ["8", "16"]
    metrics = answer["metrics"]
    assert metrics["num_llm_calls"] == 4 and metrics["num_tool_calls"] == 3
    for name in ("llm_latency_ms", "tool_latency_ms", "total_latency_ms"):
        assert metrics[name] > 0, (name, metrics)
    calls = trainer.calls_of(rid)
    assert metrics["prompt_tokens"] == sum(len(c.prompt_ids) for c in calls)
    assert metrics["max_context_tokens"] == max(len(c.prompt_ids) for c in calls)
    assert metrics["response_tokens"] == sum(len(c.token_ids) for c in calls)
    assert all(c.extends_buffer for c in calls[1:]), "the masks stay exact"
    episode_id = answer["episode_id"]
    results = tool_results(api_store, episode_id)
    assert results[:2] == [("add", "8", None), ("multiply", "16", None)]
    assert results[2][0] == "subtract" and results[2][2] == "ToolNotFoundError"
    started = [r.event for r in api_store.read_stream(episode_id)][0]
    assert [t["function"]["name"] for t in started.tools] == ["add", "multiply"]
    finish_with_reward(http, api_store, episode_id, "completed",
                       project.headers("read"))

    # a tool call on the last allowed turn runs, as the reference runs it
    body = request(trainer, run_id, tokenizer_name=str(tiny_model_dir), max_turns=1)
    trainer.script(body["rollout_id"], [tool_call("add", a=1, b=2)])
    r = http.post("/rollout", json=body)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert (answer["status"], answer["finish_reason"]) == ("COMPLETED", "max_turns")
    assert answer["final_messages"][-1]["role"] == "tool"
    assert answer["final_messages"][-1]["content"] == "3"
    assert answer["metrics"]["num_tool_calls"] == 1
    assert tool_results(api_store, answer["episode_id"]) == [("add", "3", None)]
    finish_with_reward(http, api_store, answer["episode_id"], "truncated",
                       project.headers("read"))

    # the asynchronous revision answers 202 with the same tools
    body = request(trainer, run_id, tokenizer_name=str(tiny_model_dir))
    init = {"rollout_id": body["rollout_id"], "server_url": trainer.url,
            "messages": QUESTION, "api_key": "trainer-secret",
            "completion_params": body["sampling_params"], "max_turns": 4, "run_id": run_id}
    trainer.script(init["rollout_id"], [tool_call("multiply", a=6, b=7), "42."])
    r = http.post("/v1/rollout/init", json=init)
    assert r.status_code == 202, r.text
    assert [t["function"]["name"] for t in r.json()["tools"]] == ["add", "multiply"]
    report = trainer.wait_completed(init["rollout_id"])
    assert report["status"] == "COMPLETED", report
    assert report["metrics"]["llm_latency_ms"] > 0
    assert tool_results(api_store, f"rollout-{init['rollout_id']}") == [
        ("multiply", "42", None)]


def test_an_mcp_servers_tools_through_tool_server_url(
        http: httpx.Client, trainer: ChatTrainer, tiny_model_dir: Path,
        api_store: EventStore, tmp_path: Path, project: Project) -> None:
    number = {"type": "number"}
    schema = {"type": "object", "properties": {"a": number, "b": number},
              "required": ["a", "b"]}
    with McpServer({"add": ("Add two numbers", schema, lambda a, b: a + b),
                    "multiply": ("Multiply two numbers", schema, lambda a, b: a * b)}) as mcp:
        run_id = new_run(http, tiny_model_dir)
        body = request(trainer, run_id, tokenizer_name=str(tiny_model_dir),
                       tool_server_url=mcp.url)
        trainer.script(body["rollout_id"], [tool_call("add", a=5, b=3),
                                            tool_call("multiply", a=8, b=2), "16."])
        r = http.post("/rollout", json=body)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["status"] == "COMPLETED", answer["error_message"]
        assert tool_results(api_store, answer["episode_id"]) == [
            ("add", "8", None), ("multiply", "16", None)]
        assert mcp.calls == [("add", {"a": 5, "b": 3}), ("multiply", {"a": 8, "b": 2})]
        finish_with_reward(http, api_store, answer["episode_id"], "completed",
                           project.headers("read"))

        # the run's module gives add too: a clash, refused before anything is queued
        module = tmp_path / "mine.py"
        module.write_text(CALCULATOR)
        clashing = new_run(http, tiny_model_dir, tool_modules=[str(module)])
        body = request(trainer, clashing, tokenizer_name=str(tiny_model_dir),
                       tool_server_url=mcp.url)
        r = http.post("/rollout", json=body)
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["code"] == "invalid_tools" and error["field"] == "body.tool_server_url"
        assert "tool name clash: 'add'" in error["message"]
        assert api_store.read_stream(f"rollout-{body['rollout_id']}") == []
    # a tool server that is not an allowed address is refused naming the field
    body = request(trainer, run_id, tokenizer_name=str(tiny_model_dir),
                   tool_server_url="http://203.0.113.7:9/mcp")
    r = http.post("/rollout", json=body)
    assert r.status_code == 422, r.text
    assert "tool_server_url" in r.json()["error"]["message"]


def test_a_tool_module_that_cannot_be_imported_or_clashes_is_refused_at_run_creation(
        http: httpx.Client, tiny_model_dir: Path, api_store: EventStore,
        tmp_path: Path) -> None:
    broken = tmp_path / "broken_tools.py"
    broken.write_text("import no_such_package_anywhere\n")
    for modules, words in (([str(broken)], ["broken_tools.py", "cannot be imported",
                                            "ModuleNotFoundError"]),
                           (["no_such.tool_module"], ["no_such.tool_module"])):
        run_id = f"bad-{uuid.uuid4().hex[:8]}"
        r = http.post("/v1/runs", json={"run_id": run_id, "config": {
            "tokenizer": str(tiny_model_dir), "rollout": {"tool_modules": modules}}})
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["field"] == "body.config.rollout.tool_modules", error
        assert all(w in error["message"] for w in words), error
        assert api_store.stream_version(f"run-{run_id}") == 0
    one, two = tmp_path / "one.py", tmp_path / "two.py"
    one.write_text(CALCULATOR)
    two.write_text("def multiply(x: int) -> int:\n    return x\n")
    r = http.post("/v1/runs", json={"run_id": f"bad-{uuid.uuid4().hex[:8]}", "config": {
        "rollout": {"tool_modules": [str(one), str(two)]}}})
    assert r.status_code == 422, r.text
    assert "tool name clash: 'multiply'" in r.json()["error"]["message"]
