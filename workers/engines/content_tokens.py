"""The rule for special tokens in message and tool content, shared by every path that renders
a chat prompt to ids (the gateway, rollout, local backends: ``render.prompt_ids``).

A chat template writes content into its markup as text, and tokenizing that text turns any
added token's spelling into the token itself: a user message holding ``<|im_start|>`` would
open a turn of the client's choosing, a tool result holding ``</tool_response>`` would close
its block. The rule: **content that spells a control token is refused**, naming the field,
before anything is rendered or generated, so a recorded prompt never holds a control token
that came from content.

- Control tokens are the tokenizer's added tokens. In a system, user or tool message, in a
  message of any other role but the assistant's, and in tool definitions, every added token
  is refused (markup such as Qwen3's ``<tool_call>``, ``<tool_response>`` or ``<think>``
  included); in an assistant message (the model's own earlier output, markup and all) only
  the special ones (``special=True``: ``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>``…).
- Every string of a message is checked (content, text parts, names, tool-call arguments),
  and every string of a tool definition. ``role`` is not content.
- A raw prompt given as ids or as text (``/v1/completions``) is the client's own rendering
  and is not checked.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ControlTokenInContent", "check_content"]


class ControlTokenInContent(ValueError):
    """A string of a message or tool definition spells a control token; ``field`` names
    it (``messages[1].content``, ``tools[0].function.description``)."""

    def __init__(self, field: str, token: str) -> None:
        super().__init__(f"{field} holds the control token {token!r} as text; content may "
                         "not spell the tokenizer's control tokens")
        self.field = field
        self.token = token


#: tokenizer -> (pattern of every added token, pattern of the special ones)
_patterns: weakref.WeakKeyDictionary[Any, tuple[re.Pattern[str] | None,
                                                re.Pattern[str] | None]] = (
    weakref.WeakKeyDictionary())
_lock = threading.Lock()


def _compile(tokens: set[str]) -> re.Pattern[str] | None:
    tokens = {t for t in tokens if t}
    if not tokens:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))


def _tokenizer_patterns(tokenizer: Any) -> tuple[re.Pattern[str] | None,
                                                  re.Pattern[str] | None]:
    try:
        with _lock:
            hit = _patterns.get(tokenizer)
    except TypeError:  # not weakly referenceable: computed every time
        hit = None
    if hit is not None:
        return hit
    added: set[str] = set()
    special: set[str] = set(getattr(tokenizer, "all_special_tokens", None) or ())
    for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        text = str(getattr(token, "content", token))
        added.add(text)
        if getattr(token, "special", True):
            special.add(text)
    result = (_compile(added | special), _compile(special))
    try:
        with _lock:
            _patterns[tokenizer] = result
    except TypeError:
        pass
    return result


def _walk(value: Any, field: str, pattern: re.Pattern[str]) -> None:
    if isinstance(value, str):
        found = pattern.search(value)
        if found is not None:
            raise ControlTokenInContent(field, found.group(0))
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _walk(item, f"{field}.{key}", pattern)
    elif isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        for i, item in enumerate(value):
            _walk(item, f"{field}[{i}]", pattern)


def check_content(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                  tools: Sequence[Mapping[str, Any]] | None = None) -> None:
    """Raise ``ControlTokenInContent`` naming the first string of ``messages`` or ``tools``
    that spells a control token of ``tokenizer`` (module docstring)."""
    every, special = _tokenizer_patterns(tokenizer)
    if every is None:
        return
    for i, message in enumerate(messages):
        pattern = special if message.get("role") == "assistant" else every
        if pattern is None:
            continue
        for key, value in message.items():
            if key != "role":
                _walk(value, f"messages[{i}].{key}", pattern)
    for i, tool in enumerate(tools or ()):
        _walk(tool, f"tools[{i}]", every)
