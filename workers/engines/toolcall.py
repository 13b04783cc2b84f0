"""Parsing a generated assistant turn: ``<think>`` reasoning, content and Qwen-style tool calls.

A turn looks like::

    <think>
    reasoning…
    </think>

    optional text
    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2 + 3"}}
    </tool_call>
    <tool_call>
    {"name": "python", "arguments": {"code": "print(1)"}}
    </tool_call>

Rules:

- Reasoning is the text inside the first ``<think>…</think>`` block at the start of the turn.
  A ``</think>`` with no opener (templates that put ``<think>`` in the generation prompt) makes
  everything before it reasoning; an unclosed ``<think>`` makes the rest of the turn reasoning.
- Every ``<tool_call>…</tool_call>`` block outside the reasoning must hold one JSON object with a
  non-empty string ``name`` and an object ``arguments`` (a JSON string that decodes to an
  object is accepted, as some models emit OpenAI's string form). Several blocks per turn are
  allowed.
- Anything wrong (bad JSON, missing or mistyped fields, an unclosed ``<tool_call>``, a stray
  ``</tool_call>``) is a *format error*; its message starts with
  :data:`TOOL_CALL_FORMAT_ERROR`, the pattern the rollback configuration matches on. A turn with
  any format error runs none of its tool calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = [
    "TOOL_CALL_FORMAT_ERROR",
    "ParsedResponse",
    "ParsedToolCall",
    "parse_response",
]

#: The prefix of every format error message (matched by ``rollback_on_errors``).
TOOL_CALL_FORMAT_ERROR = "tool call format is wrong"

_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
_CALL_OPEN, _CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ParsedToolCall:
    """One well-formed tool call: its id (unique within the episode), name and arguments."""

    id: str
    name: str
    arguments: dict[str, Any]

    def to_openai(self) -> dict[str, Any]:
        """OpenAI format: ``{id, type: "function", function: {name, arguments: JSON string}}``."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name,
                         "arguments": json.dumps(self.arguments, ensure_ascii=False)},
        }


@dataclass(frozen=True)
class ParsedResponse:
    """A generated turn split into reasoning, content, tool calls and format errors.

    ``reasoning_first`` is True when a closed, non-empty ``<think>`` block starts the turn.
    ``attempted_tool_call`` is True when the text contains a tool-call tag at all.
    ``malformed_calls`` holds the raw text of each block that failed to parse.
    """

    content: str
    reasoning_content: str | None
    tool_calls: tuple[ParsedToolCall, ...] = ()
    format_errors: tuple[str, ...] = ()
    malformed_calls: tuple[str, ...] = ()
    attempted_tool_call: bool = False
    reasoning_first: bool = False

    @property
    def well_formed(self) -> bool:
        """True when the turn has no format error."""
        return not self.format_errors

    def to_message(self) -> dict[str, Any]:
        """The assistant message in OpenAI format (``tool_calls`` only when there are some)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        return message


def _split_reasoning(text: str) -> tuple[str | None, str, bool]:
    """Return ``(reasoning, rest, closed_block_first)``."""
    stripped = text.lstrip()
    if stripped.startswith(_THINK_OPEN):
        body = stripped[len(_THINK_OPEN):]
        end = body.find(_THINK_CLOSE)
        if end < 0:
            return body.strip(), "", False
        reasoning = body[:end].strip()
        return reasoning, body[end + len(_THINK_CLOSE):], bool(reasoning)
    end = text.find(_THINK_CLOSE)
    if end >= 0 and _THINK_OPEN not in text[:end] and _CALL_OPEN not in text[:end]:
        reasoning = text[:end].strip()
        return reasoning, text[end + len(_THINK_CLOSE):], bool(reasoning)
    return None, text, False


def _decode_call(body: str) -> tuple[str, dict[str, Any]]:
    """Decode one tool-call body; raises ValueError with the reason."""
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
                         ) from None
    if not isinstance(payload, dict):
        raise ValueError(f"expected a JSON object, got {type(payload).__name__}")
    name = payload.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"field 'name' must be a non-empty string, got {name!r}")
    if "arguments" not in payload:
        raise ValueError("field 'arguments' is missing")
    arguments = payload["arguments"]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise ValueError("field 'arguments' is a string that is not valid JSON") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"field 'arguments' must be an object, got {type(arguments).__name__}")
    return name.strip(), arguments


def parse_response(text: str, *, call_id: str) -> ParsedResponse:
    """Parse one generated turn (decoded text, control tokens removed).

    Tool-call ids are ``f"{call_id}-{index}"`` (index over the well-formed calls), so they are
    unique when ``call_id`` is unique. Malformed calls do not raise: they are reported in
    ``format_errors`` (see the module docstring). Raises TypeError when ``text`` is not a str
    and ValueError for an empty ``call_id``.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if not isinstance(call_id, str) or not call_id:
        raise ValueError(f"call_id must be a non-empty string, got {call_id!r}")
    reasoning, rest, reasoning_first = _split_reasoning(text)
    content_parts: list[str] = []
    calls: list[ParsedToolCall] = []
    errors: list[str] = []
    malformed: list[str] = []
    cursor = 0
    while True:
        start = rest.find(_CALL_OPEN, cursor)
        stray = rest.find(_CALL_CLOSE, cursor)
        if stray >= 0 and (start < 0 or stray < start):
            errors.append(f"{TOOL_CALL_FORMAT_ERROR}: {_CALL_CLOSE} without a matching "
                          f"{_CALL_OPEN}")
            malformed.append(rest[cursor: stray + len(_CALL_CLOSE)].strip())
            content_parts.append(rest[cursor:stray])
            cursor = stray + len(_CALL_CLOSE)
            continue
        if start < 0:
            content_parts.append(rest[cursor:])
            break
        content_parts.append(rest[cursor:start])
        body_start = start + len(_CALL_OPEN)
        end = rest.find(_CALL_CLOSE, body_start)
        nested = rest.find(_CALL_OPEN, body_start)
        if end < 0 or (0 <= nested < end):
            stop = nested if 0 <= nested and (end < 0 or nested < end) else len(rest)
            errors.append(f"{TOOL_CALL_FORMAT_ERROR}: {_CALL_OPEN} is not closed by "
                          f"{_CALL_CLOSE}")
            malformed.append(rest[start:stop].strip())
            cursor = stop
            if stop == len(rest):
                break
            continue
        body = rest[body_start:end]
        try:
            name, arguments = _decode_call(body.strip())
        except ValueError as exc:
            errors.append(f"{TOOL_CALL_FORMAT_ERROR}: {exc}")
            malformed.append(body.strip())
        else:
            calls.append(ParsedToolCall(id=f"{call_id}-{len(calls)}", name=name,
                                        arguments=arguments))
        cursor = end + len(_CALL_CLOSE)
    attempted = _CALL_OPEN in rest or _CALL_CLOSE in rest
    return ParsedResponse(
        content="".join(content_parts).strip(),
        reasoning_content=reasoning,
        tool_calls=tuple(calls),
        format_errors=tuple(errors),
        malformed_calls=tuple(malformed),
        attempted_tool_call=attempted,
        reasoning_first=reasoning_first,
    )
