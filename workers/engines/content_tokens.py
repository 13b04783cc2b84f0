"""The rule for special tokens in message and tool content, shared by every path that renders
a chat prompt to ids (the gateway, rollout, local backends: ``render.prompt_ids``).

A chat template writes content into its markup as text, and tokenizing that text turns any
added token's spelling into the token itself: a user message holding ``<|im_start|>`` would
open a turn of the client's choosing, a tool result holding ``</tool_response>`` would close
its block. The rule: **content that spells a control token is refused**, naming the field,
before anything is rendered or generated, so a recorded prompt never holds a control token
that came from content.

- Control tokens are the tokenizer's special tokens (``special=True`` among its added tokens,
  and ``all_special_tokens``: Qwen3's ``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>``…),
  which only the template writes: they are refused in every message, whatever its role, and
  in tool definitions. Markup tokens that are not special (Qwen3's ``<think>``,
  ``<tool_call>``, ``<tool_response>``) are words of the model's format that system prompts
  and earlier assistant turns use as a matter of course (a system prompt that says "answer
  in a <tool_call> block"): they are tokenized as every tokenizer of the model tokenizes
  them, and left to the template and the model. A tool result that spells
  ``</tool_response>`` can thus close its block early; that is the format's, not the
  store's, and the recorded prompt shows it exactly as the model saw it.
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


#: tokenizer -> pattern of its special tokens (None: it has none)
_patterns: weakref.WeakKeyDictionary[Any, re.Pattern[str] | None] = weakref.WeakKeyDictionary()
_NONE = re.compile(r"(?!)")  # cached stand-in for "no special token": matches nothing
_lock = threading.Lock()


def _compile(tokens: set[str]) -> re.Pattern[str] | None:
    tokens = {t for t in tokens if t}
    if not tokens:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))


def _tokenizer_patterns(tokenizer: Any) -> re.Pattern[str] | None:
    try:
        with _lock:
            hit = _patterns.get(tokenizer)
    except TypeError:  # not weakly referenceable: computed every time
        hit = None
    if hit is not None:
        return None if hit is _NONE else hit
    special: set[str] = set(getattr(tokenizer, "all_special_tokens", None) or ())
    for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(token, "special", True):
            special.add(str(getattr(token, "content", token)))
    result = _compile(special)
    try:
        with _lock:
            _patterns[tokenizer] = _NONE if result is None else result
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
    special = _tokenizer_patterns(tokenizer)
    if special is None:
        return
    for i, message in enumerate(messages):
        for key, value in message.items():
            if key != "role":
                _walk(value, f"messages[{i}].{key}", special)
    for i, tool in enumerate(tools or ()):
        _walk(tool, f"tools[{i}]", special)
