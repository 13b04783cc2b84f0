"""Remote rollout (TrainGate protocol) against a real ``trajstore serve`` process whose
in-process engine is a tiny Qwen3-architecture model with the real Qwen3 tokenizer that has
learnt one tool conversation. The RolloutServer side is written here, as the protocol's
reference RolloutSession: it sends the full messages and a ``response_mask`` of zeros for
the tokens added since the last generation."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from store.eventlog import EventStore
from store.events import LLMCalled, ToolReturned
from store.settings import Settings
from tests.api.conftest import Project, Server
from tests.api.qwen3_tool_model import (
    ADD_TOOL,
    ANSWER,
    QUESTION,
    REASONING_1,
    REASONING_2,
    build_qwen3_tool_model,
    generations,
)
from tests.workers.conftest import Worker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

#: What the RolloutServer adds after the ``add`` call returned 8, with Qwen3's template.
TOOL_TURN = ("\n<|im_start|>user\n<tool_response>\n8\n</tool_response><|im_end|>\n"
             "<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def qwen3() -> Any:
    from workers.engines.tokenizers import load_tokenizer

    return load_tokenizer("qwen3")


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_qwen3_tool_model(tmp_path_factory.mktemp("qwen3-tool") / "model")


@pytest.fixture(scope="module")
def server(pg_url: str, tmp_path_factory: pytest.TempPathFactory, tool_model: Path,
           rollout_broker: str) -> Iterator[Server]:
    settings = Settings(database_url=pg_url, data_dir=tmp_path_factory.mktemp("remote"),
                        api_key_scrypt_n=1024)
    s = Server(settings, settings.data_dir / "server.log",
               TRAJSTORE_REDIS_URL=rollout_broker,
               TRAJSTORE_GATEWAY_ENGINE_MODEL=str(tool_model),
               TRAJSTORE_GATEWAY_MAX_TOKENS="64")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


class RolloutSession:
    """The RolloutServer's bookkeeping of one rollout (the protocol's reference pattern):
    ``last_prompt_length`` is the prompt plus generation of the previous call; the mask of a
    call is one 0 per token the conversation grew by since."""

    def __init__(self, http: httpx.Client, tokenizer: Any, rollout_id: str, *,
                 path: str = "/v1/completions") -> None:
        self.http = http
        self.tokenizer = tokenizer
        self.rollout_id = rollout_id
        self.path = path
        self.messages: list[dict[str, Any]] = [dict(m) for m in QUESTION]
        self.last_prompt_length = 0
        self.masks: list[list[int] | None] = []

    def prompt_length(self) -> int:
        return len(self.tokenizer.apply_chat_template(
            self.messages, tools=[ADD_TOOL], add_generation_prompt=True, tokenize=True,
            return_dict=False))

    def call(self, *, mask: Any = "protocol", **extra: Any) -> dict[str, Any]:
        length = self.prompt_length()
        if mask == "protocol":
            mask = None if self.last_prompt_length == 0 else \
                [0] * (length - self.last_prompt_length)
        self.masks.append(mask)
        r = self.http.post(self.path, json={
            "model": "default", "rollout_id": self.rollout_id, "messages": self.messages,
            "response_mask": mask, "temperature": 0, "max_tokens": 64, "logprobs": True,
            **extra})
        assert r.status_code == 200, r.text
        body = r.json()
        self.last_prompt_length = length + len(body["token_ids"])
        return body


def new_rollout(http: httpx.Client, project: Project) -> str:
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    r = http.post("/v1/runs", json={"run_id": run_id, "config": {"group_size": 1,
                                                                 "tokenizer": "qwen3"}},
                  headers=project.headers("ingest"))
    assert r.status_code == 201, r.text
    rollout_id = f"rollout-{uuid.uuid4().hex[:10]}"
    r = http.post(f"/v1/runs/{run_id}/episodes", json={
        "episode_id": rollout_id, "group_id": "g0", "tools": [ADD_TOOL],
        "messages": QUESTION}, headers=project.headers("ingest"))
    assert r.status_code == 201, r.text
    return rollout_id


def run_tool(call: dict[str, Any]) -> str:
    assert call["type"] == "function" and call["function"]["name"] == "add"
    args = json.loads(call["function"]["arguments"])
    return str(args["a"] + args["b"])


def recorded(store: EventStore, rollout_id: str) -> list[LLMCalled]:
    return [r.event for r in store.read_stream(rollout_id) if isinstance(r.event, LLMCalled)]


@pytest.fixture
def http(server: Server, project: Project) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120,
                      headers={"Authorization": f"Bearer {project.ingest}"}) as c:
        yield c


def test_tool_conversation_records_exactly_the_template_and_tool_tokens_as_context(
        http: httpx.Client, project: Project, qwen3: Any, api_store: EventStore) -> None:
    rollout_id = new_rollout(http, project)
    session = RolloutSession(http, qwen3, rollout_id)
    first = session.call()
    message = first["choices"][0]["message"]
    assert first["mask_check"]["status"] == "first_call"
    assert message["reasoning_content"] == REASONING_1
    (call,) = message["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"a": 5, "b": 3}
    assert first["choices"][0]["finish_reason"] == "tool_calls"
    end = qwen3.convert_tokens_to_ids("<|im_end|>")
    assert first["token_ids"][-1] == end and len(first["logprobs"]) == len(first["token_ids"])
    assert qwen3.decode(first["token_ids"][:-1]) == generations()[0]
    assert first["prompt_token_ids"] == qwen3.apply_chat_template(
        QUESTION, tools=[ADD_TOOL], add_generation_prompt=True, tokenize=True,
        return_dict=False)

    session.messages += [message, {"role": "tool", "tool_call_id": call["id"],
                                   "content": run_tool(call)}]
    second = session.call()
    assert session.masks[-1] == [0] * 14
    assert second["mask_check"] == {"status": "ok", "reasons": [],
                                    "buffer_length": session.last_prompt_length
                                    - len(second["token_ids"]) - 14,
                                    "prompt_length": len(second["prompt_token_ids"]),
                                    "new_tokens": 14, "mask_length": 14, "divergence": None}
    answer = second["choices"][0]["message"]
    assert answer["content"] == ANSWER and answer["reasoning_content"] == REASONING_2
    assert "tool_calls" not in answer and second["choices"][0]["finish_reason"] == "stop"
    session.messages.append(answer)

    done = http.post("/v1/rollout/completed", json={
        "rollout_id": rollout_id, "status": "COMPLETED", "final_messages": session.messages,
        "finish_reason": "stop", "reward": 1.0, "metrics": {"num_llm_calls": 2}})
    assert done.status_code == 200 and done.json()["duplicate"] is False
    again = http.post("/v1/rollout/completed", json={
        "rollout_id": rollout_id, "status": "COMPLETED", "final_messages": session.messages,
        "finish_reason": "stop", "reward": 1.0})
    assert again.status_code == 200 and again.json()["duplicate"] is True

    types = [r.type for r in api_store.read_stream(rollout_id)]
    assert types == ["episode_started", "llm_called", "tool_returned", "llm_called",
                     "reward_assigned", "episode_finished"]
    # The RolloutServer's tool result, as the second call's messages carry it, is a fact.
    (tool,) = [r.event for r in api_store.read_stream(rollout_id)
               if isinstance(r.event, ToolReturned)]
    assert (tool.tool_call_id, tool.name, tool.arguments, tool.output, tool.is_error) == (
        call["id"], "add", {"a": 5, "b": 3}, "8", False)
    calls = recorded(api_store, rollout_id)
    assert [c.response["mask_check"]["status"] for c in calls] == ["first_call", "ok"]
    # The store's own buffer: the second prompt is the first prompt + generation + 14.
    buffer = np.concatenate([calls[0].prompt_ids, calls[0].response_ids])
    assert calls[1].prompt_ids[: len(buffer)].tolist() == buffer.tolist()
    assert qwen3.decode(calls[1].prompt_ids[len(buffer):].tolist()) == TOOL_TURN

    # The replayed timeline: trained exactly on the two generations, and the context between
    # them is exactly the 14 template and tool tokens.
    got = http.get(f"/v1/episodes/{rollout_id}/timelines",
                   headers=project.headers("read")).json()
    (timeline,) = got["timelines"]
    ids = np.asarray(timeline["token_ids"])
    mask = np.asarray(timeline["loss_mask"])
    generated = calls[0].response_ids.tolist() + calls[1].response_ids.tolist()
    assert ids[mask == 1].tolist() == generated
    trained = np.flatnonzero(mask)
    gap = np.flatnonzero(np.diff(trained) > 1)
    assert len(gap) == 1  # one stretch of context between the two generations
    start, stop = trained[gap[0]] + 1, trained[gap[0] + 1]
    assert stop - start == 14
    assert qwen3.decode(ids[start:stop].tolist()) == TOOL_TURN
    assert ids[:start].tolist() == buffer.tolist()


def _rollout_with_first_call(http: httpx.Client, project: Project, qwen3: Any,
                             path: str = "/v1/completions") -> RolloutSession:
    session = RolloutSession(http, qwen3, new_rollout(http, project), path=path)
    first = session.call()
    message = first["choices"][0]["message"]
    call = message["tool_calls"][0]
    session.messages += [message, {"role": "tool", "tool_call_id": call["id"],
                                   "content": run_tool(call)}]
    return session


def test_wrong_mask_length_is_recorded_not_trusted(http: httpx.Client, project: Project,
                                                   qwen3: Any, api_store: EventStore) -> None:
    session = _rollout_with_first_call(http, project, qwen3, path="/v1/chat/completions")
    second = session.call(mask=[0] * 13, max_tokens=4)
    assert second["mask_check"]["status"] == "mismatch"
    assert second["mask_check"]["reasons"] == ["mask_length"]
    assert second["mask_check"]["new_tokens"] == 14
    assert recorded(api_store, session.rollout_id)[-1].response["mask_check"]["reasons"] == \
        ["mask_length"]


def test_think_stripping_template_is_a_recorded_prefix_mismatch(
        http: httpx.Client, project: Project, qwen3: Any, api_store: EventStore) -> None:
    session = _rollout_with_first_call(http, project, qwen3)
    del session.messages[1]["reasoning_content"]  # as a template that strips reasoning
    second = session.call(max_tokens=4)
    check = second["mask_check"]
    assert check["status"] == "mismatch" and "prefix_mismatch" in check["reasons"]
    first_prompt = recorded(api_store, session.rollout_id)[0].prompt_ids
    # The first generated token was "<think>"; the stripped rendering has "<tool_call>" there.
    assert check["divergence"] == len(first_prompt)
    event = recorded(api_store, session.rollout_id)[-1]
    assert event.response["mask_check"] == check


def test_mask_timing_errors_are_recorded(http: httpx.Client, project: Project,
                                         qwen3: Any) -> None:
    early = RolloutSession(http, qwen3, new_rollout(http, project))
    assert early.call(mask=[0, 0, 0], max_tokens=4)["mask_check"]["reasons"] == \
        ["mask_on_first_call"]
    session = _rollout_with_first_call(http, project, qwen3)
    assert session.call(mask=None, max_tokens=4)["mask_check"]["reasons"] == ["mask_missing"]
    session = _rollout_with_first_call(http, project, qwen3)
    marked = session.call(mask=[1] * 14, max_tokens=4)["mask_check"]
    assert marked["reasons"] == ["mask_marks_generated"]


def test_explicit_nulls_and_unknown_keys_are_accepted(http: httpx.Client, project: Project,
                                                      api_store: EventStore) -> None:
    rollout_id = new_rollout(http, project)
    r = http.post("/v1/completions", json={
        "model": None, "rollout_id": rollout_id, "response_mask": None, "stop": None,
        "seed": None, "tools": None, "temperature": 0, "max_tokens": 64, "top_p": None,
        "vendor_field": {"anything": [1, 2]},
        "messages": [{"role": "user", "content": QUESTION[0]["content"], "name": None,
                      "tool_calls": None, "client_meta": {"turn": 0}}]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "add"
    event = recorded(api_store, rollout_id)[0]
    assert event.messages == [{"role": "user", "content": QUESTION[0]["content"],
                               "client_meta": {"turn": 0}}]
    missing = http.post("/v1/completions", json={"rollout_id": "no-such-rollout",
                                                  "messages": QUESTION})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_rollout_server_route_drives_a_rollout_against_this_gateway(
        http: httpx.Client, server: Server, project: Project, api_store: EventStore,
        rollout_worker: Worker) -> None:
    """``POST /rollout`` (the RolloutServer side) queues the rollout; a rollout worker plays
    it, calling back this very server's ``/v1/completions`` for the trainer side: both
    episodes are recorded."""
    rollout_id = new_rollout(http, project)
    run_id = api_store.read_stream(rollout_id, to_version=1)[0].event.run_id  # type: ignore
    r = http.post("/rollout", json={
        "rollout_id": rollout_id, "server_url": server.url, "messages": QUESTION,
        "sampling_params": {"temperature": 0, "max_tokens": 8}, "tokenizer_name": "qwen3",
        "max_turns": 2, "callback_api_key": project.ingest, "run_id": run_id})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "COMPLETED", body
    assert body["metrics"]["llm_calls"] >= 1
    trainer_side = recorded(api_store, rollout_id)
    assert len(trainer_side) == body["metrics"]["llm_calls"]
    assert trainer_side[0].response["mask_check"]["status"] == "first_call"
    server_side = [r.type for r in api_store.read_stream(body["episode_id"])]
    assert server_side[0] == "episode_started" and server_side[-1] == "episode_finished"
    again = http.post("/rollout", json={
        "rollout_id": rollout_id, "server_url": server.url, "messages": QUESTION,
        "tokenizer_name": "qwen3", "run_id": run_id, "callback_api_key": project.ingest})
    assert again.status_code == 409
