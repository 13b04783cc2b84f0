"""Remote rollouts against a real HTTP trainer endpoint that generates with the tiny model:
the response_mask the trainer receives, the recorded episode, and every trainer error
category ending the rollout with status ERROR."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from store.eventlog import EventStore
from store.settings import Settings
from tests.rollout.remote_trainer import TrainerServer
from tests.rollout.turns import tool_call, turn
from tests.servers import free_port
from workers.engines.backend_remote import unreachable_message
from workers.engines.backend_transformers import TransformersBackend
from workers.rollout.remote import run_remote_rollout
from workers.rollout.remote_request import DuplicateRolloutError, remote_episode_id

KEY = "trainer-callback-key"


@pytest.fixture(scope="module")
def trainer(hf_backend: TransformersBackend) -> Iterator[TrainerServer]:
    with TrainerServer(hf_backend, api_key=KEY) as server:
        yield server


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path)


def rollout_request(trainer: TrainerServer, tiny_model_dir: Path, **changes: Any
                    ) -> dict[str, Any]:
    request: dict[str, Any] = {
        "rollout_id": f"r-{uuid.uuid4().hex[:12]}",
        "server_url": trainer.url,
        "messages": [{"role": "system", "content": "You are a calculator assistant."},
                     {"role": "user", "content": "What is 6 * 7?"}],
        "sampling_params": {"temperature": 1.0, "top_p": 1.0, "max_tokens": 64,
                            "logprobs": True},
        "tokenizer_name": str(tiny_model_dir),
        "max_turns": 4,
        "max_tokens_total": 4096,
        "callback_api_key": KEY,
    }
    request.update(changes)
    return request


def test_multi_turn_tool_rollout_sends_the_exact_mask(
        trainer: TrainerServer, tiny_model_dir: Path, hf_backend: TransformersBackend,
        store: EventStore, settings: Settings) -> None:
    request = rollout_request(trainer, tiny_model_dir)
    rid = request["rollout_id"]
    trainer.script(rid, [turn("multiply", tool_call("calculator", expression="6 * 7")),
                         turn("two calls", tool_call("calculator", expression="42 + 0"),
                              tool_call("calculator", expression="1 / 0")),
                         "The answer is 42."])
    response = run_remote_rollout(request, store=store, settings=settings)

    assert response["status"] == "COMPLETED", response
    assert response["finish_reason"] == "stop"
    assert response["error_message"] is None and response["error_category"] is None
    assert response["metrics"]["llm_calls"] == 3
    assert response["metrics"]["tool_calls"] == 3
    assert response["metrics"]["prompt_length_mismatches"] == 0

    calls = trainer.calls(rid)
    assert len(calls) == 3
    assert calls[0].response_mask is None
    assert all(c.authorization == f"Bearer {KEY}" for c in calls)
    for call in calls[1:]:
        assert call.extends_buffer, "each prompt must extend the previous prompt + generation"
        assert call.expected_zeros and call.expected_zeros > 0
        assert call.response_mask == [0] * call.expected_zeros
    decode = hf_backend.tokenizer.decode
    assert decode(calls[1].new_prompt_ids) == (
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    second = decode(calls[2].new_prompt_ids)
    assert second.count("<tool_response>") == 2 and "ZeroDivisionError" in second
    body = calls[1].body
    assert body["rollout_id"] == rid and body["logprobs"] is True
    assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "tool"]
    assert body["tools"][0]["function"]["name"] == "calculator"

    final = response["final_messages"]
    assert [m["role"] for m in final] == ["system", "user", "assistant", "tool", "assistant",
                                          "tool", "tool", "assistant"]
    assert final[3]["content"] == "42" and final[-1]["content"] == "The answer is 42."

    events = store.get_episode(remote_episode_id(rid))
    types = [e.type for e in events]
    # The trainer scores the rollout: no reward is recorded here (none is invented).
    assert types[0] == "episode_started" and types[-1] == "episode_finished"
    assert "reward_assigned" not in types
    assert types.count("llm_called") == 3 and "rolled_back" not in types
    recorded = [e.event for e in events if e.type == "llm_called"]
    for record, call in zip(recorded, calls, strict=True):
        assert record.prompt_ids.tolist() == call.prompt_ids
    assert events[-1].event.status == "completed"
    assert events[0].event.run_id == "remote"


def test_vllm_answer_form_and_passthrough_sampling(
        trainer: TrainerServer, tiny_model_dir: Path, store: EventStore,
        settings: Settings) -> None:
    request = rollout_request(trainer, tiny_model_dir, run_id="run-remote-x",
                              group_id="group-7",
                              sampling_params={"temperature": 0.8, "max_tokens": 64,
                                               "top_k": 5, "seed": 3})
    rid = request["rollout_id"]
    trainer.vllm_form(rid)
    trainer.script(rid, ["<think>\nnothing to compute\n</think>\n\nHello."])
    response = run_remote_rollout(request, store=store, settings=settings)
    assert response["status"] == "COMPLETED", response
    (call,) = trainer.calls(rid)
    assert call.body["top_k"] == 5 and call.body["seed"] == 3
    assert call.body["temperature"] == 0.8
    final = response["final_messages"][-1]
    assert final["reasoning_content"] == "nothing to compute"
    assert final["content"] == "Hello."
    events = store.get_episode(remote_episode_id(rid))
    assert events[0].event.run_id == "run-remote-x"
    assert events[0].event.group_id == "group-7"
    (llm,) = [e.event for e in events if e.type == "llm_called"]
    assert llm.logprobs.shape == llm.response_ids.shape and (llm.logprobs <= 0).all()


def test_sampled_rollout_hits_max_turns_or_stops(
        trainer: TrainerServer, tiny_model_dir: Path, store: EventStore,
        settings: Settings) -> None:
    request = rollout_request(trainer, tiny_model_dir, max_turns=1)
    rid = request["rollout_id"]
    trainer.script(rid, [turn("go", tool_call("calculator", expression="2 + 2"))])
    response = run_remote_rollout(request, store=store, settings=settings)
    assert response["status"] == "COMPLETED"
    assert response["finish_reason"] == "max_turns"

    sampled = rollout_request(trainer, tiny_model_dir,
                              sampling_params={"max_tokens": 8, "seed": 1})
    response = run_remote_rollout(sampled, store=store, settings=settings)
    assert response["status"] == "COMPLETED"
    assert response["finish_reason"] in ("stop", "max_tokens", "max_turns")
    assert response["metrics"]["generated_tokens"] >= 1


def test_token_budget_ends_with_max_tokens(
        trainer: TrainerServer, tiny_model_dir: Path, store: EventStore,
        settings: Settings) -> None:
    request = rollout_request(trainer, tiny_model_dir, max_tokens_total=500,
                              sampling_params={"max_tokens": 1000})
    rid = request["rollout_id"]
    expression = " + ".join(["1"] * 40)
    trainer.script(rid, [turn("add", tool_call("calculator", expression=expression))] * 5)
    response = run_remote_rollout(request, store=store, settings=settings)
    assert response["status"] == "COMPLETED", response
    assert response["finish_reason"] == "max_tokens"
    assert response["metrics"]["llm_calls"] >= 2
    calls = trainer.calls(rid)
    assert calls[-1].body["max_tokens"] == 500 - len(calls[-1].prompt_ids)
    (finished,) = [e.event for e in store.get_episode(remote_episode_id(rid))
                   if e.type == "episode_finished"]
    assert "max_total_tokens" in finished.reason or "max_tokens" in finished.reason


@pytest.mark.parametrize(("kind", "on_call", "category", "status_code"), [
    (429, 2, "rate_limited", 429),
    (503, 2, "server_error", 503),
    (500, 2, "server_error", 500),
    (400, 2, "client_error", 400),
    ("not_json", 2, "malformed", None),
    ("missing_token_ids", 2, "malformed", None),
    ("short_logprobs", 2, "malformed", None),
])
def test_trainer_errors_end_the_rollout_with_a_category(
        trainer: TrainerServer, tiny_model_dir: Path, store: EventStore, settings: Settings,
        kind: Any, on_call: int, category: str, status_code: int | None) -> None:
    request = rollout_request(trainer, tiny_model_dir)
    rid = request["rollout_id"]
    trainer.script(rid, [turn("go", tool_call("calculator", expression="6 * 7")),
                         "The answer is 42."])
    trainer.fail(rid, kind, on_call=on_call)
    response = run_remote_rollout(request, store=store, settings=settings)
    assert response["status"] == "ERROR"
    assert response["error_category"] == category
    assert response["error_message"].startswith(f"{category}: ")
    if status_code is not None:
        assert str(status_code) in response["error_message"]
    assert response["finish_reason"] is None
    assert response["metrics"]["llm_calls"] == on_call - 1
    events = store.get_episode(remote_episode_id(rid))
    assert events[-1].event.status == "error"
    assert events[-2].event.type == "reward_assigned"


def _unreachable(response: dict[str, Any], server_url: str) -> str:
    assert response["status"] == "ERROR" and response["error_category"] == "network"
    assert response["error_message"] == f"network: {unreachable_message(server_url)}"
    assert response["metrics"]["llm_calls"] == 0
    return str(response["error_message"]).replace(server_url, "<url>")


@pytest.mark.parametrize(("kind", "status_code"), [
    (429, 429), (500, 500), (400, 400), ("not_json", None), ("short_logprobs", None)])
def test_a_first_call_failure_reads_as_unreachable(
        trainer: TrainerServer, tiny_model_dir: Path, store: EventStore, settings: Settings,
        kind: Any, status_code: int | None) -> None:
    """Before the trainer answered once, its failures say nothing about what answered."""
    request = rollout_request(trainer, tiny_model_dir)
    trainer.script(request["rollout_id"], ["The answer is 42."])
    trainer.fail(request["rollout_id"], kind, on_call=1)
    response = run_remote_rollout(request, store=store, settings=settings)
    _unreachable(response, trainer.url)
    if status_code is not None:  # (the trainer's URL, whose port may hold the digits, aside)
        assert str(status_code) not in response["error_message"].replace(trainer.url, "")


def test_a_wrong_key_reads_as_unreachable(trainer: TrainerServer, tiny_model_dir: Path,
                                          store: EventStore, settings: Settings) -> None:
    request = rollout_request(trainer, tiny_model_dir, callback_api_key="not-the-key")
    response = run_remote_rollout(request, store=store, settings=settings)
    _unreachable(response, trainer.url)
    assert "401" not in response["error_message"].replace(trainer.url, "")


def test_closed_non_http_and_http_ports_read_the_same(
        trainer: TrainerServer, tiny_model_dir: Path, store: EventStore,
        settings: Settings) -> None:
    """A closed port, a port that takes connections but speaks no HTTP, and an HTTP server
    that is not a trainer: one message, one category."""
    import socket
    import threading

    closed = f"http://127.0.0.1:{free_port()}"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    stop = threading.Event()

    def babble() -> None:  # answers every connection with a non-HTTP line and closes it
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(b"-ERR not http\r\n")

    thread = threading.Thread(target=babble, daemon=True)
    thread.start()
    non_http = f"http://127.0.0.1:{listener.getsockname()[1]}"
    not_a_trainer = f"{trainer.url}/elsewhere"
    try:
        messages = set()
        for url in (closed, non_http, not_a_trainer):
            request = rollout_request(trainer, tiny_model_dir, server_url=url)
            response = run_remote_rollout(request, store=store, settings=settings,
                                          timeout_s=5.0)
            messages.add(_unreachable(response, url))
            (finished,) = [e.event for e in store.get_episode(
                remote_episode_id(request["rollout_id"])) if e.type == "episode_finished"]
            assert "ConnectError" not in str(finished.reason)
            assert "404" not in str(finished.reason)
        assert len(messages) == 1
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()


def test_network_errors(trainer: TrainerServer, tiny_model_dir: Path, store: EventStore,
                        settings: Settings) -> None:
    closed_url = f"http://127.0.0.1:{free_port()}"
    closed = rollout_request(trainer, tiny_model_dir, server_url=closed_url)
    response = run_remote_rollout(closed, store=store, settings=settings)
    _unreachable(response, closed_url)

    slow = rollout_request(trainer, tiny_model_dir)
    trainer.fail(slow["rollout_id"], "slow")
    response = run_remote_rollout(slow, store=store, settings=settings, timeout_s=0.5)
    _unreachable(response, trainer.url)


def test_duplicate_rollout_id_is_refused(trainer: TrainerServer, tiny_model_dir: Path,
                                         store: EventStore, settings: Settings) -> None:
    request = rollout_request(trainer, tiny_model_dir)
    trainer.script(request["rollout_id"], ["Done."])
    assert run_remote_rollout(request, store=store, settings=settings)["status"] == "COMPLETED"
    with pytest.raises(DuplicateRolloutError, match="rollout_id"):
        run_remote_rollout(request, store=store, settings=settings)
    # episode_started, the call, episode_finished: the trainer scores it (no reward here)
    assert len(store.get_episode(remote_episode_id(request["rollout_id"]))) == 3
