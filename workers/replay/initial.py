"""Initial timelines: one per LLM call, before any merging.

The timeline of a call is its request messages, each carrying its segment of the engine's
prompt ids (``segment.Segmenter``), then the generated message: the generation prompt's tokens
(not sampled) followed by the generated ids with their logprobs (sampled). Only the generated
ids are trainable. A generation cut off by the length limit is marked ``truncated``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from workers.replay.equality import content_text
from workers.replay.errors import ReplayError
from workers.replay.segment import Segmenter
from workers.replay.timeline import (
    LLM_AUTHOR,
    Message,
    Timeline,
    _check_agent,
    _int_list,
    _tool_list,
)

__all__ = ["author_of", "build_initial_timeline", "generated_message", "request_message"]

_AUTHORS = {"user": "user", "tool": "tool"}


def author_of(role: str) -> str:
    """The author of a request message with ``role``: ``user``, ``tool`` or ``env`` (system
    prompts, and assistant turns the model did not generate in this call)."""
    return _AUTHORS.get(role, "env")


def request_message(message: Mapping[str, Any], token_ids: Sequence[int]) -> Message:
    """The timeline message of one OpenAI-format request message with its prompt tokens.
    Raises TypeError when ``message`` has no string ``role``, its content is of the wrong
    type or ``token_ids`` is not a sequence of integers."""
    return _request_message(message, token_ids, trusted=False)


def _request_message(message: Mapping[str, Any], token_ids: Sequence[int], *,
                     trusted: bool = True) -> Message:
    """``request_message``; ``trusted``: ``token_ids`` is known to be a list of Python ints
    (a segmentation's), so it is copied without checking each id again."""
    role = message.get("role") if isinstance(message, Mapping) else None
    if not isinstance(role, str) or not role:
        raise TypeError(f"a request message must be a mapping with a string 'role', got "
                        f"{message!r:.80}")
    text = content_text(message.get("content"))
    ids = list(token_ids) if trusted else _int_list(token_ids, "Message.token_ids")
    return Message._built(role, author_of(role), text, ids, None,
                          tool_calls=message.get("tool_calls") or None)


def generated_message(response: Mapping[str, Any], *, generation_prompt_ids: Sequence[int],
                      response_ids: Sequence[int] | np.ndarray,
                      logprobs: Sequence[float] | np.ndarray,
                      finish_reason: str | None) -> Message:
    """The model's message: generation prompt tokens (not sampled, logprob 0) then the
    generated tokens (sampled, with their logprobs). Raises ValueError when ``logprobs`` and
    ``response_ids`` differ in length and TypeError when ``response`` is not a mapping."""
    if not isinstance(response, Mapping):
        raise TypeError(f"response must be a mapping, got {type(response).__name__}")
    gen = [int(i) for i in generation_prompt_ids]
    # Integer and float32 arrays give the same Python ints and floats without a widening
    # copy first.
    out = (response_ids.tolist() if isinstance(response_ids, np.ndarray)
           and response_ids.dtype.kind == "i"
           else np.asarray(response_ids, dtype=np.int64).tolist())
    lps = (logprobs.tolist() if isinstance(logprobs, np.ndarray)
           and logprobs.dtype in (np.float32, np.float64)
           else np.asarray(logprobs, dtype=np.float64).tolist())
    if len(lps) != len(out):
        raise ValueError(f"logprobs has {len(lps)} entries but response_ids has {len(out)}")
    # Lists of Python ints and floats of one length, built here: no second check.
    return Message._built(
        str(response.get("role") or "assistant"), LLM_AUTHOR,
        content_text(response.get("content")), gen + out, [0.0] * len(gen) + lps,
        tool_calls=response.get("tool_calls") or None, truncated=finish_reason == "length",
        sampled=[0] * len(gen) + [1] * len(out))


def build_initial_timeline(
    *,
    agent: str,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    prompt_ids: Sequence[int] | np.ndarray,
    response_ids: Sequence[int] | np.ndarray,
    logprobs: Sequence[float] | np.ndarray,
    response: Mapping[str, Any],
    finish_reason: str | None,
    segmenter: Segmenter,
    call_id: str | None = None,
) -> Timeline:
    """The initial timeline of one LLM call. Raises ReplayError (with the ``call_id``) when
    the call has no request messages or its prompt cannot be segmented, TypeError for
    arguments of the wrong type."""
    if not isinstance(segmenter, Segmenter):
        raise TypeError(f"segmenter must be a Segmenter, got {type(segmenter).__name__}")
    _check_agent(agent, "agent")
    if not messages:
        raise ReplayError("the call has no request messages", call_id=call_id)
    seg = segmenter.segment(messages, tools=tools, prompt_ids=prompt_ids, call_id=call_id)
    # Messages whose segments a call took over from an earlier call's segmentation are the
    # same timeline messages: take them over too.
    earlier = segmenter.memo.get(seg.base) if seg.base is not None and seg.reused else None
    timeline_messages = list(earlier[:seg.reused]) if earlier is not None else []
    done = len(timeline_messages)
    timeline_messages += [_request_message(m, ids) for m, ids in
                          zip(messages[done:], seg.message_ids[done:], strict=True)]
    segmenter.memo[seg.key] = list(timeline_messages)
    try:
        timeline_messages.append(generated_message(
            response, generation_prompt_ids=seg.generation_prompt_ids,
            response_ids=response_ids, logprobs=logprobs, finish_reason=finish_reason))
    except ValueError as exc:
        raise ReplayError(str(exc), call_id=call_id) from exc
    # Messages built here and the agent checked: no second check.
    return Timeline._built(agent, timeline_messages, _tool_list(tools, "tools") or None)
