"""Reward functions, registered by name: ``(ground_truth, transcript) -> Reward``.

Built in:

- ``function_call`` (EGPO's strict binary reward, "single criteria"): 1 only when the last
  kept assistant turn starts with a closed, non-empty ``<think>…</think>`` block, is followed by
  nothing but well-formed ``<tool_call>`` blocks, and those calls equal the ground truth after
  normalisation; otherwise 0. Normalisation: names are stripped; arguments compare as JSON
  values with object keys unordered, numbers by value (``2 == 2.0``, booleans are not numbers)
  and strings stripped of surrounding whitespace; several calls compare as a multiset (order
  free). Components: ``format`` and ``correct`` (each 0 or 1).
- ``final_answer``: 1 when the last number in the final assistant message equals the ground
  truth number (relative tolerance 1e-9); components ``correct`` and ``used_tools`` (whether
  any tool result is in the final context).
- ``tool_answer`` (EGPO's strict binary reward for multi-turn tool use): 1 only when every
  kept assistant turn starts with a closed, non-empty ``<think>…</think>`` block and has no
  format error, at least one tool result that is not an error is in the final context, and the
  last assistant turn makes no tool call and its last number equals the ground truth.
  Components ``format``, ``used_tool`` and ``correct`` (each 0 or 1).
- ``unscored``: no reward (None), for episodes whose reward is computed elsewhere (remote
  rollouts: the caller scores ``final_messages`` and may post the reward later); the episode
  records no ``reward_assigned`` and is not trainable until one arrives. The ground truth
  must be None.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from workers.engines.toolcall import parse_response

__all__ = [
    "REWARDS",
    "Reward",
    "RewardFn",
    "Transcript",
    "GROUND_TRUTH_CHECKS",
    "check_function_call_ground_truth",
    "check_ground_truth",
    "final_answer_reward",
    "function_call_reward",
    "get_reward",
    "normalize_call",
    "register_reward",
    "tool_answer_reward",
    "unscored_reward",
    "digit_share_reward",
]


@dataclass(frozen=True)
class Transcript:
    """What a reward function sees: the final context (``messages``, OpenAI format), the raw
    generated text of each assistant turn kept in it (``assistant_texts``, in order) and the
    episode status."""

    messages: tuple[dict[str, Any], ...]
    assistant_texts: tuple[str, ...]
    status: str = "completed"


@dataclass(frozen=True)
class Reward:
    """A scalar reward, its named components and where it came from."""

    value: float
    components: dict[str, float] = field(default_factory=dict)
    source: str = "task"


#: A reward function; None means "not scored here": no reward is recorded (none is invented).
RewardFn = Callable[[Any, Transcript], Reward | None]
GroundTruthCheck = Callable[[Any], Any]

#: Reward functions by name.
REWARDS: dict[str, RewardFn] = {}
#: Per reward, the function that validates a ground truth (raises ValueError when bad).
GROUND_TRUTH_CHECKS: dict[str, GroundTruthCheck] = {}


def register_reward(
    name: str, *, check_ground_truth: GroundTruthCheck | None = None
) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering a reward function under ``name``, with an optional validator of
    its ground truth (used when tasks are loaded). A name registered twice raises ValueError."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"reward name must be a non-empty string, got {name!r}")

    def decorate(function: RewardFn) -> RewardFn:
        if name in REWARDS:
            raise ValueError(f"reward {name!r} is already registered")
        REWARDS[name] = function
        if check_ground_truth is not None:
            GROUND_TRUTH_CHECKS[name] = check_ground_truth
        return function

    return decorate


def get_reward(name: str) -> RewardFn:
    """The reward function called ``name``; raises ValueError listing the known names."""
    try:
        return REWARDS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown reward {name!r}; known: {sorted(REWARDS)}") from None


def check_ground_truth(name: str, ground_truth: Any) -> None:
    """Validate ``ground_truth`` for reward ``name`` (no-op when the reward has no validator).
    Raises ValueError for an unknown reward or a ground truth the reward cannot use."""
    get_reward(name)
    check = GROUND_TRUTH_CHECKS.get(name)
    if check is not None:
        check(ground_truth)


def _normalize_value(value: Any) -> Any:
    if isinstance(value, bool) or value is None:
        return ("literal", value)
    if isinstance(value, (int, float)):
        return ("number", float(value))
    if isinstance(value, str):
        return ("string", value.strip())
    if isinstance(value, Mapping):
        return ("object", tuple(sorted((str(k), _normalize_value(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return ("array", tuple(_normalize_value(v) for v in value))
    raise TypeError(f"value of type {type(value).__name__} is not a JSON value")


def normalize_call(name: str, arguments: Mapping[str, Any]) -> tuple[str, Any]:
    """A hashable, order-free form of one call for comparison (module docstring).
    Raises TypeError for argument values that are not JSON values."""
    return name.strip(), _normalize_value(dict(arguments))


def check_function_call_ground_truth(ground_truth: Any) -> list[dict[str, Any]]:
    """Validate a function-call ground truth: one ``{"name", "arguments"}`` object or a
    non-empty list of them. Returns the list. Raises ValueError naming the faulty entry."""
    calls = [ground_truth] if isinstance(ground_truth, Mapping) else ground_truth
    if not isinstance(calls, list) or not calls:
        raise ValueError(f"expected a call object or a non-empty list of calls, "
                         f"got {ground_truth!r}")
    for index, call in enumerate(calls):
        if not isinstance(call, Mapping):
            raise ValueError(f"call [{index}] must be an object, got {call!r}")
        if not isinstance(call.get("name"), str) or not call["name"].strip():
            raise ValueError(f"call [{index}] field 'name' must be a non-empty string, "
                             f"got {call.get('name')!r}")
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                raise ValueError(f"call [{index}] field 'arguments' is not valid JSON") from None
        if not isinstance(arguments, Mapping):
            raise ValueError(f"call [{index}] field 'arguments' must be an object, "
                             f"got {arguments!r}")
    return [dict(call) for call in calls]


@register_reward("function_call", check_ground_truth=check_function_call_ground_truth)
def function_call_reward(ground_truth: Any, transcript: Transcript) -> Reward:
    """EGPO's strict binary function-calling reward (module docstring). A malformed
    ``ground_truth`` raises ValueError."""
    expected_calls = check_function_call_ground_truth(ground_truth)
    expected = Counter(
        normalize_call(call["name"], json.loads(call["arguments"])
                       if isinstance(call.get("arguments"), str) else call.get("arguments", {}))
        for call in expected_calls
    )
    if not transcript.assistant_texts:
        return Reward(0.0, {"format": 0.0, "correct": 0.0}, source="function_call")
    parsed = parse_response(transcript.assistant_texts[-1], call_id="reward")
    format_ok = (parsed.reasoning_first and parsed.well_formed and bool(parsed.tool_calls)
                 and parsed.content == "")
    try:
        produced = Counter(normalize_call(c.name, c.arguments) for c in parsed.tool_calls)
    except TypeError:
        produced = Counter()
    correct = bool(parsed.tool_calls) and parsed.well_formed and produced == expected
    value = 1.0 if format_ok and correct else 0.0
    return Reward(value, {"format": float(format_ok), "correct": float(correct)},
                  source="function_call")


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?")


def _last_number(text: str) -> float | None:
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    try:
        return float(matches[-1].replace(",", ""))
    except ValueError:
        return None


def _numeric_ground_truth(ground_truth: Any) -> float:
    """The ground truth as a float; raises ValueError when it is not a number."""
    if isinstance(ground_truth, bool):
        raise ValueError(f"ground_truth must be a number, got {ground_truth!r}")
    try:
        value = float(str(ground_truth).strip())
    except ValueError:
        raise ValueError(f"ground_truth must be a number, got {ground_truth!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"ground_truth must be finite, got {ground_truth!r}")
    return value


@register_reward("final_answer", check_ground_truth=_numeric_ground_truth)
def final_answer_reward(ground_truth: Any, transcript: Transcript) -> Reward:
    """1 when the final assistant message's last number equals ``ground_truth`` (a number or a
    numeric string); raises ValueError when ``ground_truth`` is not numeric."""
    target = _numeric_ground_truth(ground_truth)
    used_tools = any(m.get("role") == "tool" for m in transcript.messages)
    final = next((m for m in reversed(transcript.messages) if m.get("role") == "assistant"),
                 None)
    answer = _last_number(final.get("content") or "") if final is not None else None
    correct = answer is not None and math.isclose(answer, target, rel_tol=1e-9, abs_tol=1e-9)
    return Reward(1.0 if correct else 0.0,
                  {"correct": float(correct), "used_tools": float(used_tools)},
                  source="final_answer")


_TOOL_ERROR_LINE = re.compile(r"^(?:\w+(?:Error|Exception)\b|tool call format is wrong)")


def _tool_result_ok(message: Mapping[str, Any]) -> bool:
    """A tool message whose text is non-empty and has no line naming an error."""
    content = str(message.get("content") or "")
    return bool(content.strip()) and not any(
        _TOOL_ERROR_LINE.match(line.strip()) for line in content.splitlines())


@register_reward("tool_answer", check_ground_truth=_numeric_ground_truth)
def tool_answer_reward(ground_truth: Any, transcript: Transcript) -> Reward:
    """EGPO's strict binary reward for tool use (module docstring); raises ValueError when
    ``ground_truth`` is not numeric."""
    target = _numeric_ground_truth(ground_truth)
    zero = Reward(0.0, {"format": 0.0, "used_tool": 0.0, "correct": 0.0}, source="tool_answer")
    if not transcript.assistant_texts:
        return zero
    parsed = [parse_response(text, call_id=f"r{i}")
              for i, text in enumerate(transcript.assistant_texts)]
    format_ok = all(p.reasoning_first and p.well_formed for p in parsed)
    used_tool = any(m.get("role") == "tool" and _tool_result_ok(m)
                    for m in transcript.messages)
    last = parsed[-1]
    answer = _last_number(last.content) if not last.tool_calls else None
    correct = answer is not None and math.isclose(answer, target, rel_tol=1e-9, abs_tol=1e-9)
    value = 1.0 if format_ok and used_tool and correct else 0.0
    return Reward(value, {"format": float(format_ok), "used_tool": float(used_tool),
                          "correct": float(correct)}, source="tool_answer")


def _no_ground_truth(ground_truth: Any) -> None:
    """Raises ValueError unless ``ground_truth`` is None."""
    if ground_truth is not None:
        raise ValueError(f"the unscored reward takes no ground truth, got {ground_truth!r}")


@register_reward("unscored", check_ground_truth=_no_ground_truth)
def unscored_reward(ground_truth: Any, transcript: Transcript) -> Reward | None:
    """No reward: the episode is scored by someone else (remote rollouts), who may post it
    later; until then the episode is not trainable (``no_reward``), rather than trained as a
    failure with a made-up 0. Raises ValueError when ``ground_truth`` is not None."""
    _no_ground_truth(ground_truth)
    return None


@register_reward("digit_share")
def digit_share_reward(ground_truth: Any, transcript: Transcript) -> Reward:
    """Share of the last assistant text's characters that are ASCII digits (0 when empty):
    the demo's task, one a tiny model learns in minutes on a CPU. ``ground_truth`` is
    ignored."""
    text = transcript.assistant_texts[-1] if transcript.assistant_texts else ""
    share = sum(ch.isascii() and ch.isdigit() for ch in text) / len(text) if text else 0.0
    return Reward(share, {"digits": share})
