"""Episodes with known failures, recorded as the agent loop records them.

``Episode`` describes an episode turn by turn: each turn is a list of attempts at one
position ``turn_N`` (a tool call and its outcome). A failing attempt that ``rollback`` marks is
recorded as the loop records it: ``attempt_failed``, a regenerated ``llm_called`` whose request
is the context plus the failed turn and the error feedback, ``rolled_back`` to the attempt's
checkpoint, and a new checkpoint with the next retry count; a failing attempt at the retry limit
ends the episode ``terminated``. A failing attempt without ``rollback`` keeps its error in the
context and the episode goes on. Prompts are rendered with the real Qwen3 chat template.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from store.events import (
    AttemptFailed,
    CheckpointCreated,
    EpisodeFinished,
    EpisodeStarted,
    Event,
    LLMCalled,
    RewardAssigned,
    RolledBack,
    ToolReturned,
)
from tests.replay.replay_episodes import SEARCH_TOOL, Script

__all__ = ["CALC_TOOL", "DURATIONS", "Attempt", "Episode", "new_episode_id", "record_events"]

CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}

#: Every call of a tool takes this long (ms), so that mean durations are known.
DURATIONS = {"search": 20.0, "calc": 5.0}


@dataclass(frozen=True)
class Attempt:
    """One try at a position: the tool called, its arguments and what it returned."""

    tool: str
    arguments: dict[str, Any]
    output: str
    error_type: str | None = None
    rollback: bool = True


@dataclass(frozen=True)
class Episode:
    run_id: str
    group_id: str
    question: str
    turns: Sequence[Sequence[Attempt]]
    answer: str
    reward: float
    policy_version: int = 0
    max_tool_retries: int = 3
    tools: Sequence[dict[str, Any]] = field(default_factory=lambda: [SEARCH_TOOL, CALC_TOOL])


def _assistant(attempt: Attempt, call_id: str) -> dict[str, Any]:
    return {"role": "assistant", "content": "",
            "tool_calls": [{"id": call_id, "type": "function",
                            "function": {"name": attempt.tool,
                                         "arguments": json.dumps(attempt.arguments)}}]}


def record_events(tokenizer: Any, episode: Episode) -> list[Event]:
    """The event stream of ``episode`` (see the module docstring)."""
    s = Script(tokenizer, tools=list(episode.tools), group_id=episode.group_id)
    s.events[0] = EpisodeStarted(run_id=episode.run_id, group_id=episode.group_id,
                                 tools=list(episode.tools),
                                 policy_version=episode.policy_version)
    context: list[dict[str, Any]] = [{"role": "user", "content": episode.question}]
    status = "completed"
    n = 0

    def call(messages: list[dict[str, Any]], response: dict[str, Any]) -> str:
        nonlocal n
        n += 1
        call_id = f"call-{n}"
        s.call(messages, response, call_id=call_id)
        return call_id

    for turn, attempts in enumerate(episode.turns, start=1):
        key = f"turn_{turn}"
        message = _assistant(attempts[0], f"tc-{turn}-0")
        call_id = call(context, message)
        for retry, attempt in enumerate(attempts):
            checkpoint = f"ckpt_{turn}_{retry}"
            s.events.append(CheckpointCreated(checkpoint_id=checkpoint, position_key=key,
                                              retry_count=retry))
            failed = attempt.error_type is not None
            s.events.append(ToolReturned(
                tool_call_id=f"tc-{turn}-{retry}", name=attempt.tool,
                arguments=attempt.arguments, output=attempt.output, is_error=failed,
                error_type=attempt.error_type,
                error_message=attempt.output if failed else None,
                duration_ms=DURATIONS[attempt.tool]))
            if not (failed and attempt.rollback):
                assert retry == len(attempts) - 1, "only the last attempt may pass a position"
                context = [*context, message,
                           {"role": "tool", "tool_call_id": f"tc-{turn}-{retry}",
                            "content": attempt.output}]
                break
            s.events.append(AttemptFailed(
                checkpoint_id=checkpoint, position_key=key, retry_index=retry,
                error_messages=[attempt.output], error_types=[attempt.error_type or ""],
                failed_tool_calls=[{"id": f"tc-{turn}-{retry}", "name": attempt.tool,
                                    "arguments": attempt.arguments}],
                failed_call_id=call_id))
            if retry + 1 > episode.max_tool_retries:
                assert retry == len(attempts) - 1, "no attempt after the retry limit"
                status = "terminated"
                break
            feedback = {"role": "user",
                        "content": f"The tool call failed: {attempt.output}. Fix it."}
            failed_message = message
            message = _assistant(attempts[retry + 1], f"tc-{turn}-{retry + 1}")
            regenerated = call([*context, failed_message, feedback], message)
            s.events.append(RolledBack(checkpoint_id=checkpoint, discarded_call_ids=[call_id]))
            call_id = regenerated
        if status != "completed":
            break
    if status == "completed":
        call(context, {"role": "assistant", "content": episode.answer})
    s.events.append(RewardAssigned(value=episode.reward))
    s.events.append(EpisodeFinished(status=status))
    return [e.model_copy(update={"policy_version": episode.policy_version})
            if isinstance(e, LLMCalled) else e for e in s.events]


def new_episode_id() -> str:
    return f"ep-{uuid.uuid4().hex[:10]}"
