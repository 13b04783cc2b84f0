"""Recording realistic finished episodes for the API tests: prompts rendered with the real
Qwen3 chat template and tokenized, generations tokenized from the assistant turn the template
writes, an ``add`` tool, optional failed attempts (negative samples)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import numpy as np

from store.eventlog import EventStore, run_stream_id
from store.events import (
    AttemptFailed,
    CheckpointCreated,
    EpisodeFinished,
    EpisodeStarted,
    Event,
    LLMCalled,
    RewardAssigned,
    RolledBack,
    RunConfig,
    RunCreated,
    ToolReturned,
)

ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                     "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


def add_call(a: int, b: int, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": "add", "arguments": json.dumps({"a": a, "b": b})}}


class Recorder:
    """Builds one episode stream with ``tokenizer``'s chat template."""

    def __init__(self, tokenizer: Any, *, seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.rng = np.random.default_rng(seed)
        self.calls = 0

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def render(self, messages: list[dict[str, Any]], generation: bool) -> str:
        return str(self.tokenizer.apply_chat_template(
            messages, tools=[ADD_TOOL], tokenize=False, add_generation_prompt=generation))

    def call(self, messages: list[dict[str, Any]], reply: dict[str, Any], *,
             agent: str = "main", policy_version: int = 0) -> LLMCalled:
        self.calls += 1
        prompt = self.render(messages, True)
        full = self.render([*messages, reply], False)
        assert full.startswith(prompt)
        generated = self.encode(full[len(prompt):].rstrip("\n"))
        return LLMCalled(
            agent=agent, call_id=f"call-{uuid.uuid4().hex[:8]}", messages=messages,
            tools=[ADD_TOOL], prompt_ids=self.encode(prompt), response_ids=generated,
            logprobs=-self.rng.uniform(0.01, 2.0, len(generated)), response=reply,
            finish_reason="stop", policy_version=policy_version)


def create_run(store: EventStore, run_id: str, *, project: str, group_size: int = 2,
               max_negatives: int = 1) -> None:
    config = RunConfig(group_size=group_size, tokenizer="qwen3",
                       negatives={"max_negative_samples_per_group": max_negatives})
    store.append(run_stream_id(run_id), [RunCreated(run_id=run_id, project=project,
                                                    config=config)], "no_stream")


def episode_events(tokenizer: Any, *, run_id: str, group_id: str, a: int, b: int,
                   reward: float, failed_attempt: bool = False, tool_error: str | None = None,
                   policy_version: int = 0, seed: int = 0) -> list[Event]:
    """A finished episode: the model calls ``add(a, b)``, reads the result, answers. With
    ``failed_attempt`` a first, malformed-argument call fails, is recorded as a failed
    attempt and rolled back. With ``tool_error`` the tool fails once with that error
    type (not rolled back) before the good call."""
    rec = Recorder(tokenizer, seed=seed)
    user = [{"role": "user", "content": f"What is {a} plus {b}?"}]
    events: list[Event] = [EpisodeStarted(run_id=run_id, group_id=group_id, task_id="add",
                                          messages=user, tools=[ADD_TOOL],
                                          policy_version=policy_version)]
    if failed_attempt:
        bad = {"role": "assistant", "content": "", "tool_calls": [add_call(a, -1, "c0")]}
        failed = rec.call(user, bad, policy_version=policy_version)
        events += [failed, CheckpointCreated(checkpoint_id="k1", position_key="turn_1"),
                   ToolReturned(name="add", tool_call_id="c0", output="NameError: bad",
                                is_error=True, error_type="NameError", error_message="bad"),
                   AttemptFailed(checkpoint_id="k1", position_key="turn_1", retry_index=0,
                                 error_messages=["bad"], error_types=["NameError"],
                                 failed_call_id=failed.call_id),
                   RolledBack(checkpoint_id="k1", discarded_call_ids=[failed.call_id])]
    good = {"role": "assistant", "content": "", "tool_calls": [add_call(a, b, "c1")]}
    events.append(rec.call(user, good, policy_version=policy_version))
    if tool_error is not None:
        events.append(ToolReturned(name="add", tool_call_id="c1", output="error",
                                   is_error=True, error_type=tool_error, error_message="x"))
    answer = str(a + b)
    context = [*user, good, {"role": "tool", "tool_call_id": "c1", "content": answer}]
    events.append(ToolReturned(name="add", tool_call_id="c1", arguments={"a": a, "b": b},
                               output=answer))
    events.append(rec.call(context, {"role": "assistant", "content": f"It is {answer}."},
                           policy_version=policy_version))
    events += [RewardAssigned(value=reward), EpisodeFinished(status="completed")]
    return events


def record_group(store: EventStore, tokenizer: Any, *, run_id: str, group_id: str,
                 size: int = 2, failed_attempt: bool = False, project_now: bool = True,
                 policy_version: int = 0) -> list[str]:
    """``size`` finished episodes of one group (rewards 1, 0, 1, …), projected."""
    from workers.replay.jobs.project import project_episode

    ids = []
    for i in range(size):
        episode_id = f"{group_id}-ep{i}-{uuid.uuid4().hex[:6]}"
        events = episode_events(tokenizer, run_id=run_id, group_id=group_id, a=3 + i, b=5,
                                reward=float((i + 1) % 2), failed_attempt=failed_attempt and
                                i == 0, policy_version=policy_version, seed=i)
        store.append(episode_id, events, "no_stream")
        if project_now:
            outcome = project_episode(store, episode_id)
            assert outcome.outcome == "written" and outcome.status == "completed", outcome
        ids.append(episode_id)
    return ids
