"""When two timeline messages count as the same message: the keys merging and fork detection
compare, and exact interning of message prefixes.

Text level: role, content and tool calls (function name and parsed arguments; call ids and
formatting of the argument JSON do not matter). Token level: the token ids. A tool list is
compared by its canonical JSON. Keys are hashable so that comparing two timelines never means
walking two token arrays side by side: prefixes are interned into small integers, one dict
lookup per message.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Literal, Protocol


class KeyedMessage(Protocol):
    """What a key reads of a message (``workers.replay.timeline.Message`` has it)."""

    @property
    def role(self) -> str: ...
    @property
    def text(self) -> str: ...
    @property
    def tool_calls(self) -> Sequence[Mapping[str, Any]] | None: ...
    @property
    def token_ids(self) -> Sequence[int]: ...

__all__ = [
    "CompareLevel",
    "KeyedMessage",
    "PrefixInterner",
    "content_text",
    "message_key",
    "text_key",
    "token_key",
    "tool_calls_key",
    "tools_key",
]

CompareLevel = Literal["text", "token"]


def _canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      default=str)


def content_text(content: Any) -> str:
    """The text of an OpenAI message ``content``: a string as is, ``None`` as ``""``, a list of
    parts as the concatenation of its ``text`` parts (other parts as canonical JSON).
    Raises TypeError for any other type."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        pieces = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                pieces.append(str(part.get("text", "")))
            else:
                pieces.append(_canonical_json(part))
        return "".join(pieces)
    raise TypeError(f"message content must be a string, a list of parts or None, "
                    f"got {type(content).__name__}")


#: Argument strings up to this length have their keys cached (merging and fork detection
#: key the same calls of an episode, and a call's history recurs in every later call).
_CACHED_ARGUMENTS = 4096


@functools.lru_cache(maxsize=1024)
def _string_arguments_key(arguments: str) -> str:
    try:
        return _canonical_json(json.loads(arguments))
    except ValueError:
        return "raw:" + arguments


def _arguments_key(arguments: Any) -> str:
    if isinstance(arguments, str):
        if len(arguments) <= _CACHED_ARGUMENTS:
            return _string_arguments_key(arguments)
        return _string_arguments_key.__wrapped__(arguments)
    return _canonical_json(arguments)


def tool_calls_key(tool_calls: Sequence[Mapping[str, Any]] | None) -> tuple[tuple[str, str], ...]:
    """``(name, canonical arguments)`` per call, in order. Accepts the OpenAI shape
    ``{"function": {"name", "arguments"}}`` and the flat ``{"name", "arguments"}``; arguments
    given as a JSON string are parsed (an unparsable string is compared verbatim). ``None`` and
    ``[]`` are the same. Raises TypeError when a call is not a mapping."""
    if not tool_calls:
        return ()
    out = []
    for i, call in enumerate(tool_calls):
        if not isinstance(call, Mapping):
            raise TypeError(f"tool_calls[{i}] must be a mapping, got {type(call).__name__}")
        fn = call.get("function", call)
        if not isinstance(fn, Mapping):
            raise TypeError(f"tool_calls[{i}].function must be a mapping, "
                            f"got {type(fn).__name__}")
        out.append((str(fn.get("name", "")), _arguments_key(fn.get("arguments", {}))))
    return tuple(out)


def tools_key(tools: Sequence[Mapping[str, Any]] | None) -> str:
    """Canonical JSON of a tool list; ``None`` and ``[]`` give the same key."""
    return _canonical_json(list(tools or []))


def text_key(message: KeyedMessage) -> tuple[str, str, tuple[tuple[str, str], ...]]:
    """``(role, text, tool calls key)``: equal keys mean equal messages at text level."""
    return (message.role, message.text, tool_calls_key(message.tool_calls))


def token_key(message: KeyedMessage) -> tuple[int, ...]:
    """The token ids as a tuple: equal keys mean equal messages at token level."""
    return tuple(message.token_ids)


def message_key(message: KeyedMessage, level: CompareLevel) -> Hashable:
    """The key of ``message`` at compare ``level`` (``"text"`` or ``"token"``); raises
    ValueError for any other level."""
    if level == "text":
        return text_key(message)
    if level == "token":
        return token_key(message)
    raise ValueError(f"compare level must be 'text' or 'token', got {level!r}")


class PrefixInterner:
    """Gives every distinct prefix of keys a small integer id.

    ``child(parent, key)`` returns the id of the prefix ``parent + [key]``; equal prefixes get
    equal ids and different ones different ids (exactly: keys are compared by the dict, not
    by a hash alone). ``root(key)`` starts a prefix. Each call costs one hash of ``key``.
    """

    def __init__(self) -> None:
        self._keys: dict[Hashable, int] = {}
        self._prefixes: dict[tuple[int, int], int] = {}

    def key_id(self, key: Hashable) -> int:
        """The id of ``key`` itself (equal keys, equal ids)."""
        found = self._keys.get(key)
        if found is None:
            found = len(self._keys)
            self._keys[key] = found
        return found

    def child(self, parent: int, key: Hashable) -> int:
        """The id of the prefix ``parent`` extended by ``key``."""
        pair = (parent, self.key_id(key))
        found = self._prefixes.get(pair)
        if found is None:
            found = len(self._prefixes) + 1
            self._prefixes[pair] = found
        return found

    def root(self, key: Hashable) -> int:
        """The id of the one-element prefix ``[key]`` (prefix id 0 is the empty prefix)."""
        return self.child(0, key)
