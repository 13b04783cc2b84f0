"""An example tool-using episode recorded through the store API: ``trajstore example``.

Tokens are the UTF-8 bytes of a ChatML rendering, so the example needs no tokenizer files or
model; it shows what an episode's events look like in a few seconds (the real loop is
``trajstore demo``).
"""

from __future__ import annotations

import json
import random
import uuid
from typing import Any

import numpy as np

from store.eventlog import NO_STREAM, EventStore, run_stream_id
from store.events import (
    CheckpointCreated,
    EpisodeFinished,
    EpisodeStarted,
    Event,
    LLMCalled,
    RewardAssigned,
    RunConfig,
    RunCreated,
    ToolReturned,
)

__all__ = ["record_example_episode"]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


def _render(messages: list[dict[str, Any]]) -> str:
    parts = [f"<|im_start|>{m['role']}\n{m.get('content') or ''}<|im_end|>\n" for m in messages]
    return "".join(parts) + "<|im_start|>assistant\n"


def _ids(text: str) -> np.ndarray:
    return np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int32)


def record_example_episode(store: EventStore, *, seed: int = 0, run_id: str,
                           tokenizer: Any = None, tokenizer_name: str | None = None
                           ) -> tuple[str, str]:
    """Record a run and one two-turn calculator episode in it; returns (run id, episode id).

    With ``tokenizer`` (a Hugging Face tokenizer with a chat template, loadable by replay as
    ``tokenizer_name``) the run names it and the token ids are its renderings of the messages,
    as an engine's would be, so the episode replays into samples. Without one, ids are the
    bytes of a hand-made rendering: the episode is stored and readable, and replay records it
    as untrainable (the run names no tokenizer)."""
    if tokenizer is not None:
        return _record_tokenized(store, seed=seed, run_id=run_id, tokenizer=tokenizer,
                                 tokenizer_name=tokenizer_name)
    rng = random.Random(seed)
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    store.append(run_stream_id(run_id), [RunCreated(run_id=run_id)], NO_STREAM)
    episode_id = f"{run_id}-ep-{uuid.uuid4().hex[:8]}"
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": f"What is {a} * {b}? Use the calculator."}
    ]
    events: list[Event] = [
        EpisodeStarted(run_id=run_id, group_id=f"{run_id}-g0", task_id=f"mul-{a}-{b}",
                       messages=messages, tools=TOOLS, sampling_params={"temperature": 1.0})
    ]
    arguments: dict[str, Any] = {"expression": f"{a} * {b}"}
    call: dict[str, Any] = {"name": "calculator", "arguments": arguments}
    first = (
        f"<think>I should multiply {a} by {b}.</think>"
        f"<tool_call>{json.dumps(call)}</tool_call><|im_end|>"
    )
    answer = f"<think>The tool says {a * b}.</think>{a} * {b} = {a * b}<|im_end|>"
    np_rng = np.random.default_rng(seed)
    for turn, text in enumerate([first, answer]):
        prompt = _ids(_render(messages))
        out = _ids(text)
        response: dict[str, Any] = {
            "role": "assistant",
            "content": text.split("</think>")[1].removesuffix("<|im_end|>"),
        }
        if turn == 0:
            response = {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call-0", "type": "function",
                 "function": {"name": "calculator", "arguments": json.dumps(arguments)}}]}
        events.append(LLMCalled(
            call_id=f"call-{turn}", messages=list(messages), tools=TOOLS, prompt_ids=prompt,
            response_ids=out, logprobs=-np_rng.exponential(0.3, len(out)), response=response,
            finish_reason="stop",
        ))
        if turn == 0:
            events.append(CheckpointCreated(checkpoint_id="ckpt-0", position_key="turn_0"))
            events.append(ToolReturned(tool_call_id="call-0", name="calculator",
                                       arguments=arguments, output=str(a * b)))
            messages = messages + [{"role": "assistant", "content": text.removesuffix(
                "<|im_end|>")}, {"role": "tool", "content": str(a * b)}]
    events += [
        RewardAssigned(value=1.0, components={"correct": 1.0}, source="exact_match"),
        EpisodeFinished(status="completed"),
    ]
    store.append(episode_id, events, NO_STREAM)
    return run_id, episode_id


def _record_tokenized(store: EventStore, *, seed: int, run_id: str, tokenizer: Any,
                      tokenizer_name: str | None) -> tuple[str, str]:
    rng = random.Random(seed)
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    config = RunConfig(group_size=1, tokenizer=tokenizer_name)
    store.append(run_stream_id(run_id), [RunCreated(run_id=run_id, config=config)], NO_STREAM)
    episode_id = f"{run_id}-ep-{uuid.uuid4().hex[:8]}"

    def render(messages: list[dict[str, Any]], generation: bool) -> str:
        return str(tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                                 add_generation_prompt=generation))

    def encode(text: str) -> np.ndarray:
        return np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"])

    messages: list[dict[str, Any]] = [
        {"role": "user", "content": f"What is {a} * {b}? Use the calculator."}
    ]
    events: list[Event] = [
        EpisodeStarted(run_id=run_id, group_id=f"{run_id}-g0", task_id=f"mul-{a}-{b}",
                       messages=messages, tools=TOOLS, sampling_params={"temperature": 1.0})
    ]
    arguments: dict[str, Any] = {"expression": f"{a} * {b}"}
    call = {"id": "call-0", "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps(arguments)}}
    replies: list[dict[str, Any]] = [
        {"role": "assistant", "content": f"I should multiply {a} by {b}.", "tool_calls": [call]},
        {"role": "assistant", "content": f"{a} * {b} = {a * b}"},
    ]
    np_rng = np.random.default_rng(seed)
    for turn, response in enumerate(replies):
        prompt = render(messages, True)
        generated = encode(render([*messages, response], False)[len(prompt):].rstrip())
        events.append(LLMCalled(
            call_id=f"call-{turn}", messages=list(messages), tools=TOOLS,
            prompt_ids=encode(prompt), response_ids=generated,
            logprobs=-np_rng.exponential(0.3, len(generated)), response=response,
            finish_reason="stop"))
        if turn == 0:
            events.append(CheckpointCreated(checkpoint_id="ckpt-0", position_key="turn_0"))
            events.append(ToolReturned(tool_call_id="call-0", name="calculator",
                                       arguments=arguments, output=str(a * b)))
            messages = [*messages, response, {"role": "tool", "content": str(a * b)}]
    events += [
        RewardAssigned(value=1.0, components={"correct": 1.0}, source="exact_match"),
        EpisodeFinished(status="completed"),
    ]
    store.append(episode_id, events, NO_STREAM)
    return run_id, episode_id
