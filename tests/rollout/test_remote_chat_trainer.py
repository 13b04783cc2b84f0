"""The RolloutServer side against a trainer of the protocol's later revision
(``tests/rollout/chat_trainer.py``): the endpoint is found by probing (``/v1/chat/completions``
first, ``/v1/completions`` when that is all the trainer serves) or named by ``server_url``;
tool calls the trainer returns outside its ``token_ids`` are run, recorded, and replay trains
only on the ids the trainer returned."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from store.eventlog import EventStore
from store.events import LLMCalled, RunConfig, ToolReturned
from store.settings import Settings
from tests.rollout.chat_trainer import ChatTrainer
from tests.rollout.turns import tool_call
from workers.engines.backend_remote import unreachable_message
from workers.engines.backend_transformers import TransformersBackend
from workers.replay.episode import replay_episode
from workers.rollout.remote import run_remote_rollout
from workers.rollout.remote_request import remote_episode_id

SCRIPT = [f"Let me multiply.\n{tool_call('calculator', expression='6 * 7')}",
          f"{tool_call('calculator', expression='42 + 0')}",
          "The answer is 42."]


@pytest.fixture(scope="module")
def chat_trainer(hf_backend: TransformersBackend) -> Iterator[ChatTrainer]:
    with ChatTrainer(hf_backend) as server:
        yield server


@pytest.fixture(scope="module")
def completions_trainer(hf_backend: TransformersBackend) -> Iterator[ChatTrainer]:
    with ChatTrainer(hf_backend, paths=("/v1/completions",)) as server:
        yield server


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path)


def request_for(trainer: ChatTrainer, tiny_model_dir: Path, **changes: Any) -> dict[str, Any]:
    """The reference revision's RolloutRequest, with its ``metadata`` and
    ``tool_server_url``."""
    return {"rollout_id": f"r-{uuid.uuid4().hex[:12]}", "server_url": trainer.url,
            "messages": [{"role": "system", "content": "You are a calculator assistant."},
                         {"role": "user", "content": "What is 6 * 7?"}],
            "sampling_params": {"temperature": 1.0, "top_p": 1.0, "max_tokens": 64,
                                "logprobs": True},
            "tokenizer_name": str(tiny_model_dir), "tokenizer_revision": "main",
            "max_turns": 5, "max_tokens_total": 4096, "metadata": {"task": "mul"},
            "tool_server_url": None, **changes}


@pytest.mark.parametrize("form,finish_reason", [("tool_calls", True), ("content", True),
                                                ("tool_calls", False)])
def test_tool_calls_outside_the_token_ids_are_run_and_replay_trains_on_the_ids_only(
        chat_trainer: ChatTrainer, tiny_model_dir: Path, hf_backend: TransformersBackend,
        store: EventStore, settings: Settings, form: str, finish_reason: bool) -> None:
    """Without a finish_reason, a turn whose ids lack the end token but whose answer carries
    tool calls finished with those calls (not a ``length`` cut); the last answer, with
    neither an end token nor tool calls, is taken as cut by the token limit."""
    request = request_for(chat_trainer, tiny_model_dir)
    rid = request["rollout_id"]
    chat_trainer.script(rid, SCRIPT, form=form, finish_reason=finish_reason)
    response = run_remote_rollout(request, store=store, settings=settings)

    assert response["status"] == "COMPLETED", response["error_message"]
    assert response["finish_reason"] == ("stop" if finish_reason else "max_tokens")
    assert response["metrics"]["llm_calls"] == 3
    assert response["metrics"]["tool_calls"] == 2
    assert response["metrics"]["tool_calls_outside_ids"] == 2
    assert response["metrics"]["trainer_endpoint"] == "/v1/chat/completions"
    # The reference RolloutMetrics' names, which its trainer reads.
    assert response["metrics"]["num_llm_calls"] == 3
    assert response["metrics"]["num_tool_calls"] == 2
    assert response["metrics"]["response_tokens"] == sum(
        len(c.token_ids) for c in chat_trainer.calls_of(request["rollout_id"]))
    assert response["metrics"]["total_latency_ms"] > 0
    final = response["final_messages"]
    assert [m["role"] for m in final] == ["system", "user", "assistant", "tool", "assistant",
                                          "tool", "assistant"]
    assert final[3]["content"] == "42" and final[-1]["content"] == "The answer is 42."
    assert final[2]["tool_calls"][0]["function"]["name"] == "calculator"

    calls = chat_trainer.calls_of(rid)
    assert [c.path for c in calls] == ["/v1/chat/completions"] * 3
    assert calls[0].token_ids and "<tool_call>" not in hf_backend.tokenizer.decode(
        calls[0].token_ids)
    assert calls[0].response_mask is None
    decode = hf_backend.tokenizer.decode
    for call in calls[1:]:
        # The trainer's buffer holds the content ids only: the tool-call text reaches it in
        # the next prompt, among the mask's zeros.
        assert call.extends_buffer, "each prompt must extend the trainer's buffer"
        assert call.response_mask == [0] * (call.expected_zeros or 0)
        assert "<tool_call>" in decode(call.new_prompt_ids)
        assert "<tool_response>" in decode(call.new_prompt_ids)

    events = [e.event for e in store.get_episode(remote_episode_id(rid))]
    llm = [e for e in events if isinstance(e, LLMCalled)]
    assert [e.response_ids.tolist() for e in llm] == [c.token_ids for c in calls]
    assert llm[0].response["tool_calls"][0]["function"]["name"] == "calculator"
    assert llm[0].response["content"] == "Let me multiply."
    assert [e.finish_reason for e in llm] == [
        "tool_calls", "tool_calls", "stop" if finish_reason else "length"]
    tools = [e for e in events if isinstance(e, ToolReturned)]
    assert [(t.name, t.output) for t in tools] == [("calculator", "42"), ("calculator", "42")]

    replayed = replay_episode(events,
                              config=RunConfig(tokenizer=str(tiny_model_dir)),
                              tokenizer=hf_backend.tokenizer)
    assert replayed.samples
    trained = [t for s in replayed.samples
               for t, m in zip(s.token_ids, s.loss_mask, strict=True) if m]
    assert sorted(trained) == sorted(t for c in calls for t in c.token_ids)
    assert "<tool_call>" not in decode(trained)


def test_a_trainer_serving_only_completions_is_found_by_the_probe(
        completions_trainer: ChatTrainer, tiny_model_dir: Path, store: EventStore,
        settings: Settings) -> None:
    request = request_for(completions_trainer, tiny_model_dir)
    rid = request["rollout_id"]
    completions_trainer.script(rid, SCRIPT)
    before = len(completions_trainer.paths)
    response = run_remote_rollout(request, store=store, settings=settings)

    assert response["status"] == "COMPLETED", response
    assert response["metrics"]["trainer_endpoint"] == "/v1/completions"
    assert response["metrics"]["tool_calls"] == 2
    # One probe of the chat path (404), then the completions path for every call.
    assert completions_trainer.paths[before:] == ["/v1/chat/completions"] + \
        ["/v1/completions"] * 3


def test_a_server_url_naming_the_path_is_not_probed(
        chat_trainer: ChatTrainer, completions_trainer: ChatTrainer, tiny_model_dir: Path,
        store: EventStore, settings: Settings) -> None:
    request = request_for(completions_trainer, tiny_model_dir,
                          server_url=completions_trainer.url + "/v1/completions")
    completions_trainer.script(request["rollout_id"], SCRIPT)
    before = len(completions_trainer.paths)
    response = run_remote_rollout(request, store=store, settings=settings)
    assert response["status"] == "COMPLETED", response
    assert completions_trainer.paths[before:] == ["/v1/completions"] * 3

    # Named, the path is used even where it is missing: no fallback, and a first call that
    # no trainer answered reads as unreachable.
    request = request_for(chat_trainer, tiny_model_dir,
                          server_url=chat_trainer.url + "/v1/completions/")
    chat_trainer.script(request["rollout_id"], SCRIPT)
    before = len(chat_trainer.paths)
    response = run_remote_rollout(request, store=store, settings=settings)
    assert response["status"] == "ERROR"
    assert response["error_category"] == "network"
    assert "unreachable" in response["error_message"] and "404" not in response["error_message"]
    assert response["metrics"]["trainer_endpoint"] == "/v1/completions"
    assert chat_trainer.paths[before:] == ["/v1/completions"]


def test_a_trainer_serving_neither_path_is_unreachable(
        chat_trainer: ChatTrainer, tiny_model_dir: Path, store: EventStore,
        settings: Settings) -> None:
    request = request_for(chat_trainer, tiny_model_dir,
                          server_url=chat_trainer.url + "/elsewhere")
    response = run_remote_rollout(request, store=store, settings=settings)
    assert response["status"] == "ERROR"
    assert response["error_category"] == "network"
    assert response["error_message"] == (
        f"network: {unreachable_message(chat_trainer.url + '/elsewhere')}")
    assert response["metrics"]["trainer_endpoint"] is None
