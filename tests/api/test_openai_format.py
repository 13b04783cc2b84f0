"""OpenAI bodies written for the in-process engine and read back by the capture: what the
engine sends through a stream folds back into the very call it generated."""

from __future__ import annotations

import json

import pytest

from api.gateway.openai_format import (
    IncompleteAnswer,
    StreamAccumulator,
    assistant_message,
    captured_chat,
    captured_completion,
    chat_chunks,
    chat_response,
    completion_chunks,
    completion_response,
    strip_extensions,
)

VOCAB = {1: "Hel", 2: "lo", 3: "!", 4: "<|im_end|>"}

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 5, "b": 3}}\n</tool_call>'


def token_text(i: int) -> str:
    return VOCAB.get(i, f"<{i}>")


def test_assistant_message_splits_reasoning_and_tool_calls() -> None:
    text = f"<think>\nadd them\n</think>\n\n{CALL}"
    with_tools = assistant_message(text, call_id="c", parse_tools=True)
    assert with_tools["reasoning_content"] == "add them"
    assert with_tools["content"] is None
    (call,) = with_tools["tool_calls"]
    assert call["id"] == "c-0" and json.loads(call["function"]["arguments"]) == {"a": 5, "b": 3}
    without = assistant_message(text, call_id="c", parse_tools=False)
    assert "tool_calls" not in without and without["content"] == CALL
    broken = assistant_message("<tool_call>\n{oops}\n</tool_call>", call_id="c",
                               parse_tools=True)
    assert "tool_calls" not in broken and broken["content"] == "<tool_call>\n{oops}\n</tool_call>"
    assert assistant_message("plain", call_id="c", parse_tools=True) == {
        "role": "assistant", "content": "plain"}
    unclosed = assistant_message("<think>\nstill thinking", call_id="c", parse_tools=True)
    assert unclosed["content"] == "" and unclosed["reasoning_content"] == "still thinking"


@pytest.mark.parametrize("message", [
    {"role": "assistant", "content": "Hello!"},
    {"role": "assistant", "content": "", "reasoning_content": "r",
     "tool_calls": [{"id": "c-0", "type": "function",
                     "function": {"name": "add", "arguments": "{\"a\": 1}"}}]},
])
def test_chat_stream_folds_back_into_the_generation(message: dict) -> None:
    ids, logprobs = [1, 2, 3, 4], [-0.1, -0.2, -0.3, -0.4]
    chunks = chat_chunks(request_id="x", created=0, model="m", message=message,
                         finish_reason="stop", prompt_ids=[7, 8], response_ids=ids,
                         logprobs=logprobs, token_text=token_text, want_logprobs=True,
                         return_token_ids=True, include_usage=True)
    acc = StreamAccumulator(chat=True)
    for c in chunks:
        acc.feed(json.loads(json.dumps(c)))
    got = acc.result()
    assert got.prompt_ids == [7, 8] and got.response_ids == ids and got.logprobs == logprobs
    assert got.message["content"] == (message["content"] or "")
    assert got.message.get("reasoning_content") == message.get("reasoning_content")
    assert got.message.get("tool_calls") == message.get("tool_calls")
    assert got.finish_reason == ("tool_calls" if "tool_calls" in message else "stop")
    assert got.usage == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}


def test_completion_bodies_and_stream_are_read_back() -> None:
    body = completion_response(request_id="x", created=0, model="m", text="Hello!",
                               finish_reason="length", prompt_ids=[5], response_ids=[1, 2],
                               logprobs=[-1.0, -2.0], token_text=token_text,
                               return_token_ids=True)
    captured = captured_completion(body)
    assert captured.response_ids == [1, 2] and captured.prompt_ids == [5]
    assert captured.message["content"] == "Hello!" and captured.finish_reason == "length"
    acc = StreamAccumulator(chat=False)
    for c in completion_chunks(request_id="x", created=0, model="m", text="Hello!",
                               finish_reason="stop", prompt_ids=[5], response_ids=[1, 2],
                               logprobs=[-1.0, -2.0], token_text=token_text,
                               want_logprobs=True, return_token_ids=True, include_usage=False):
        acc.feed(c)
    assert acc.result().response_ids == [1, 2] and acc.result().message["content"] == "Hello!"


def test_capture_refuses_answers_without_token_ids() -> None:
    body = chat_response(request_id="x", created=0, model="m",
                         message={"role": "assistant", "content": "hi"}, finish_reason="stop",
                         prompt_ids=[1], response_ids=[2], logprobs=[-0.5], token_text=None,
                         return_token_ids=True)
    with pytest.raises(IncompleteAnswer, match="no logprobs"):
        captured_chat(body)
    body["choices"][0]["logprobs"] = {"content": [{"logprob": -0.5}]}
    assert captured_chat(body).response_ids == [2]
    del body["prompt_token_ids"]
    with pytest.raises(IncompleteAnswer, match="prompt_token_ids"):
        captured_chat(body)
    with pytest.raises(IncompleteAnswer, match="no choices"):
        captured_completion({"choices": []})
    acc = StreamAccumulator(chat=True)
    acc.feed({"choices": [{"index": 0, "delta": {"content": "x"}, "token_ids": [3]}]})
    with pytest.raises(IncompleteAnswer, match="prompt_token_ids"):
        acc.result()


def test_strip_extensions_removes_what_the_caller_did_not_ask_for() -> None:
    body = chat_response(request_id="x", created=0, model="m",
                         message={"role": "assistant", "content": "hi"}, finish_reason="stop",
                         prompt_ids=[1], response_ids=[2], logprobs=[-0.5],
                         token_text=token_text, return_token_ids=True)
    stripped = strip_extensions(json.loads(json.dumps(body)), keep_logprobs=False,
                                keep_token_ids=False)
    assert "prompt_token_ids" not in stripped and "token_ids" not in stripped["choices"][0]
    assert stripped["choices"][0]["logprobs"] is None
    kept = strip_extensions(json.loads(json.dumps(body)), keep_logprobs=True,
                            keep_token_ids=True)
    assert kept == body


@pytest.mark.parametrize("message", [
    {"role": "assistant", "content": "Hello!"},
    {"role": "assistant", "content": None, "reasoning_content": "r",
     "tool_calls": [{"id": "c-0", "type": "function",
                     "function": {"name": "add", "arguments": "{\"a\": 1}"}}]},
])
@pytest.mark.parametrize("logprobs_asked", [True, False])
def test_every_body_is_what_the_openai_package_reads(message: dict, logprobs_asked: bool
                                                     ) -> None:
    """The bodies are written by hand (with vLLM's token-id extensions); the ``openai``
    package's own wire types read each of them without a loss: what they hold, dumped back,
    is what was sent (extensions aside)."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    ids, lps = [1, 2, 3, 4], [-0.1, -0.2, -0.3, -0.4]
    common = dict(request_id="x", created=1, model="m", prompt_ids=[7, 8], response_ids=ids,
                  logprobs=lps, return_token_ids=True)
    text = token_text if logprobs_asked else None

    def same(model: type, body: dict) -> None:
        read = model.model_validate(body).model_dump(mode="json", exclude_unset=True)
        sent = json.loads(json.dumps(body))
        assert read == {k: v for k, v in read.items() if k in sent}
        for key in ("id", "object", "created", "model"):
            assert read[key] == sent[key]
        assert len(read["choices"]) == len(sent["choices"])

    same(ChatCompletion, chat_response(**common, message=message, finish_reason="stop",
                                       token_text=text))
    for chunk in chat_chunks(**common, message=message, finish_reason="stop",
                             token_text=token_text, want_logprobs=logprobs_asked,
                             include_usage=True):
        same(ChatCompletionChunk, chunk)
    same(Completion, completion_response(**common, text="Hello!", finish_reason="length",
                                         token_text=text))
    for chunk in completion_chunks(**common, text="Hello!", finish_reason="stop",
                                   token_text=token_text, want_logprobs=logprobs_asked,
                                   include_usage=True):
        # OpenAI streams text completions with a null finish_reason until the last chunk,
        # which the type (shared with whole answers) does not allow: read it as "stop".
        for choice in chunk["choices"]:
            choice["finish_reason"] = choice["finish_reason"] or "stop"
        same(Completion, chunk)
