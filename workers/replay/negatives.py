"""Negative samples: failed tool-call attempts, kept to teach the model what not to do.

When a tool call fails with an error that triggers rollback, the trajectory as it stood before
the rollback (the context up to the checkpoint plus the failed generation: the initial
timeline of the failed LLM call) becomes a sample with the run's ``negative_reward``. It joins
the parent episode's GRPO group. At most ``max_per_group`` of them join one group, chosen
deterministically, earliest failure first; with saving switched off, none.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from store.arguments import whole_number
from store.events import failure_order_key
from workers.replay.samples import Sample, build_sample
from workers.replay.timeline import Timeline

__all__ = ["NegativeSample", "build_negative", "failure_order", "select_negatives",
           "turn_counts"]


@dataclass(frozen=True)
class NegativeSample:
    """A failed attempt as a training sample. ``sample`` holds tokens, mask, logprobs and the
    negative reward; the rest says what failed: the failed call, the checkpoint and its
    position key (``turn_N``), the retry index, error messages and types, the failed tool
    calls, and the assistant and user turn counts of the failed trajectory. ``group_id``,
    ``episode_id``, ``occurred_at`` and ``failure_index`` (the event's index in its episode
    stream) place it for the per-group cap."""

    sample: Sample
    call_id: str
    checkpoint_id: str
    position_key: str
    retry_index: int
    error_messages: list[str]
    error_types: list[str]
    tool_calls: list[dict[str, Any]]
    assistant_turns: int
    user_turns: int
    group_id: str | None = None
    episode_id: str | None = None
    occurred_at: dt.datetime | None = None
    failure_index: int = 0


def turn_counts(timeline: Timeline) -> tuple[int, int]:
    """``(assistant_turns, user_turns)`` of ``timeline``: assistant messages, and runs of
    consecutive ``user``/``tool`` messages after the first assistant message (one batch of
    tool responses is one turn; the opening prompt is not a turn), as verl's agent loop
    counts them. Raises TypeError when ``timeline`` is not a ``Timeline``."""
    if not isinstance(timeline, Timeline):
        raise TypeError(f"timeline must be a Timeline, got {type(timeline).__name__}")
    assistant = user = 0
    seen_assistant = False
    previous_env = False
    for m in timeline.messages:
        if m.role == "assistant":
            assistant += 1
            seen_assistant = True
            previous_env = False
        elif m.role in ("user", "tool"):
            if seen_assistant and not previous_env:
                user += 1
            previous_env = True
        else:
            previous_env = False
    return assistant, user


def _strings(value: Sequence[str], name: str) -> list[str]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a list of strings, got {type(value).__name__}")
    out = list(value)
    for i, v in enumerate(out):
        if not isinstance(v, str):
            raise TypeError(f"{name}[{i}] must be a string, got {v!r}")
    return out


def build_negative(
    timeline: Timeline,
    *,
    call_id: str,
    checkpoint_id: str,
    position_key: str,
    retry_index: int,
    error_messages: Sequence[str],
    error_types: Sequence[str],
    tool_calls: Sequence[dict[str, Any]],
    reward: float = -1.0,
    timeline_index: int = 0,
    group_id: str | None = None,
    episode_id: str | None = None,
    occurred_at: dt.datetime | None = None,
    failure_index: int = 0,
) -> NegativeSample:
    """The negative sample of a failed attempt whose trajectory is ``timeline``. Raises
    TypeError for arguments of the wrong type and ValueError for a ``position_key`` not of the
    form ``turn_N``, a negative ``retry_index`` or ``failure_index``, or a non-finite
    ``reward``."""
    for name, value in (("call_id", call_id), ("checkpoint_id", checkpoint_id)):
        if not isinstance(value, str) or not value:
            raise TypeError(f"{name} must be a non-empty string, got {value!r}")
    if not isinstance(position_key, str) or not position_key.startswith("turn_") \
            or not position_key[5:].isdigit():
        raise ValueError(f"position_key must look like 'turn_N', got {position_key!r}")
    for label, number in (("retry_index", retry_index), ("failure_index", failure_index)):
        whole_number(label, number, minimum=0)
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) \
            or not math.isfinite(reward):
        raise ValueError(f"reward must be a finite number, got {reward!r}")
    if isinstance(tool_calls, str) or not isinstance(tool_calls, Sequence):
        raise TypeError(f"tool_calls must be a list of mappings, got "
                        f"{type(tool_calls).__name__}")
    assistant, user = turn_counts(timeline)
    return NegativeSample(
        sample=build_sample(timeline, timeline_index=timeline_index, reward=float(reward)),
        call_id=call_id,
        checkpoint_id=checkpoint_id,
        position_key=position_key,
        retry_index=retry_index,
        error_messages=_strings(error_messages, "error_messages"),
        error_types=_strings(error_types, "error_types"),
        tool_calls=[dict(c) for c in tool_calls],
        assistant_turns=assistant,
        user_turns=user,
        group_id=group_id,
        episode_id=episode_id,
        occurred_at=occurred_at,
        failure_index=failure_index,
    )


def failure_order(negative: NegativeSample) -> tuple[Any, ...]:
    """The default order of failures (``store.events.failure_order_key``): by position in
    the episode stream (unknown positions last), then episode id."""
    return failure_order_key(negative.episode_id, negative.failure_index)


def select_negatives(
    negatives: Sequence[NegativeSample],
    *,
    max_per_group: int = 1,
    enabled: bool = True,
    order: Callable[[NegativeSample], Any] = failure_order,
) -> list[NegativeSample]:
    """The negatives that join their groups: per ``group_id``, the first ``max_per_group``
    by ``order`` (earliest failure first by default); none when ``enabled`` is False. The
    result is sorted by ``order``. Raises TypeError when an item is not a ``NegativeSample``
    and ValueError when ``max_per_group`` is negative."""
    whole_number("max_per_group", max_per_group, minimum=0)
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {enabled!r}")
    items = list(negatives)
    for i, n in enumerate(items):
        if not isinstance(n, NegativeSample):
            raise TypeError(f"negatives[{i}] must be a NegativeSample, got "
                            f"{type(n).__name__}")
    if not enabled or max_per_group == 0:
        return []
    taken: dict[str | None, int] = {}
    out = []
    for n in sorted(items, key=order):
        count = taken.get(n.group_id, 0)
        if count < max_per_group:
            taken[n.group_id] = count + 1
            out.append(n)
    return out
