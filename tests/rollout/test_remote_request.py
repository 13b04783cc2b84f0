"""Remote rollouts without a server: request validation, the session's response_mask rule
(checked on Qwen3's real tokenizer and template), tokenizer names, backend arguments."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from store.settings import Settings
from workers.engines.backend import GenerationRequest, SamplingParams
from workers.engines.backend_remote import (
    RemoteTrainerBackend,
    RemoteTrainerError,
    session_response_mask,
)
from workers.engines.prompt import render_prompt_ids
from workers.engines.tokenizers import load_tokenizer
from workers.rollout.remote_request import parse_rollout_request, resolve_tokenizer

GOOD: dict[str, Any] = {
    "rollout_id": "r1",
    "server_url": "http://127.0.0.1:9",
    "messages": [{"role": "user", "content": "What is 2 + 2?"}],
    "sampling_params": {"temperature": 0.7, "top_p": 0.9, "max_tokens": 512,
                        "logprobs": True},
    "tokenizer_name": "Qwen/Qwen3-8B",
    "tokenizer_revision": "main",
    "max_turns": 10,
    "max_tokens_total": 8192,
}

ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                    "b": {"type": "number"}},
                   "required": ["a", "b"]}}}


def test_good_request_parses() -> None:
    parsed = parse_rollout_request(GOOD)
    assert parsed.rollout_id == "r1" and parsed.max_turns == 10
    assert parsed.sampling == SamplingParams(temperature=0.7, top_p=0.9, max_tokens=512)
    assert parsed.callback_api_key is None and parsed.run_id == "remote"
    minimal = {k: GOOD[k] for k in ("rollout_id", "server_url", "messages", "tokenizer_name")}
    assert parse_rollout_request(minimal).max_tokens_total == 8192


@pytest.mark.parametrize(("changes", "field"), [
    ({"rollout_id": None}, "rollout_id"),
    ({"rollout_id": ""}, "rollout_id"),
    ({"rollout_id": "x" * 151}, "rollout_id"),
    ({"server_url": "trainer:8081"}, "server_url"),
    ({"server_url": 5}, "server_url"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"tokenizer_name": ""}, "tokenizer_name"),
    ({"max_turns": 0}, "max_turns"),
    ({"max_turns": True}, "max_turns"),
    ({"max_tokens_total": "many"}, "max_tokens_total"),
    ({"sampling_params": {"temperature": -1}}, "sampling_params"),
    ({"sampling_params": {"beam_width": 4}}, "sampling_params.beam_width"),
    ({"sampling_params": {"top_k": "five"}}, "sampling_params.top_k"),
    ({"sampling_params": [1]}, "sampling_params"),
    ({"callback_api_key": 12}, "callback_api_key"),
    ({"colour": "blue"}, "colour"),
])
def test_bad_requests_name_the_field(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_rollout_request({**GOOD, **changes})
    assert field in str(info.value)


def test_request_must_be_an_object() -> None:
    with pytest.raises(ValueError, match="JSON object"):
        parse_rollout_request([GOOD])


def session_mask_reference(prompts: list[list[int]], generations: list[list[int]]
                           ) -> list[list[int] | None]:
    """A plain transcription of the protocol's RolloutSession bookkeeping."""
    masks: list[list[int] | None] = []
    last = 0
    for prompt, generation in zip(prompts, generations, strict=True):
        if last > 0:
            new = len(prompt) - last
            masks.append([0] * new if new > 0 else None)
        else:
            masks.append(None)
        last = len(prompt) + len(generation)
    return masks


def test_session_mask_rule() -> None:
    assert session_response_mask(prompt_length=10, last_prompt_length=0) is None
    assert session_response_mask(prompt_length=10, last_prompt_length=10) is None
    assert session_response_mask(prompt_length=13, last_prompt_length=10) == [0, 0, 0]
    with pytest.raises(RemoteTrainerError) as info:
        session_response_mask(prompt_length=9, last_prompt_length=10)
    assert info.value.category == "response_mask"
    with pytest.raises(ValueError, match="prompt_length"):
        session_response_mask(prompt_length=-1, last_prompt_length=0)
    prompts = [[1] * 5, [1] * 12, [1] * 20, [1] * 27]
    generations = [[2] * 3, [2] * 4, [2] * 4, [2]]
    last = 0
    ours = []
    for prompt, generation in zip(prompts, generations, strict=True):
        ours.append(session_response_mask(prompt_length=len(prompt), last_prompt_length=last))
        last = len(prompt) + len(generation)
    assert ours == session_mask_reference(prompts, generations)


def test_qwen3_mask_after_an_add_call_is_the_fourteen_template_and_tool_tokens() -> None:
    tokenizer = load_tokenizer("qwen3")
    user = {"role": "user", "content": "What is 5 plus 3?"}
    sampling = SamplingParams()
    first = render_prompt_ids(tokenizer, GenerationRequest(sampling=sampling,
                                                           messages=(user,),
                                                           tools=(ADD_TOOL,)))
    arguments = {"a": 5, "b": 3}
    generated = tokenizer.encode(
        "<tool_call>\n"
        + json.dumps({"name": "add", "arguments": arguments}) + "\n</tool_call><|im_end|>")
    assistant = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "add", "arguments": json.dumps(arguments)}}]}
    tool = {"role": "tool", "tool_call_id": "c1", "content": "8"}
    second = render_prompt_ids(tokenizer, GenerationRequest(
        sampling=sampling, messages=(user, assistant, tool), tools=(ADD_TOOL,)))
    mask = session_response_mask(prompt_length=len(second),
                                 last_prompt_length=len(first) + len(generated))
    assert mask == [0] * 14
    assert tokenizer.decode(second[-14:]) == (
        "\n<|im_start|>user\n<tool_response>\n8\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")


def test_tokenizer_names(tmp_path: Path, tiny_model_dir: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    assert len(resolve_tokenizer("Qwen/Qwen3-8B", settings=settings)) == 151669
    assert resolve_tokenizer("qwen3", settings=settings) is resolve_tokenizer(
        "Qwen/Qwen3-0.6B", settings=settings)
    assert len(resolve_tokenizer(str(tiny_model_dir), settings=settings)) < 1000
    with pytest.raises(ValueError, match="tokenizer_name"):
        resolve_tokenizer("meta-llama/Llama-3-8B", settings=settings)


def test_backend_arguments(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_model_dir))
    with pytest.raises(ValueError, match="server_url"):
        RemoteTrainerBackend("ftp://x", rollout_id="r", tokenizer=tokenizer)
    with pytest.raises(ValueError, match="rollout_id"):
        RemoteTrainerBackend("http://x", rollout_id="", tokenizer=tokenizer)
    with pytest.raises(ValueError, match="endpoint"):
        RemoteTrainerBackend("http://x", rollout_id="r", tokenizer=tokenizer, endpoint="grpc")
    with pytest.raises(ValueError, match="timeout_s"):
        RemoteTrainerBackend("http://x", rollout_id="r", tokenizer=tokenizer, timeout_s=0)
    with pytest.raises(ValueError, match="category"):
        RemoteTrainerError("teapot", "no")
    with RemoteTrainerBackend("http://x", rollout_id="r", tokenizer=tokenizer) as backend:
        with pytest.raises(ValueError, match="messages"):
            backend.generate(GenerationRequest(sampling=SamplingParams(), prompt_ids=(1, 2)))
