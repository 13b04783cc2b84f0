"""Token streaming from the in-process engine: text sent while the engine samples.

The engine hands each sampled id over as it comes (``LocalEngine.generate(on_token=…)``).
``LiveText`` turns the ids so far into the next piece of text that is certainly the start of
the final answer, so the pieces sent live plus the tail sent at the end add up exactly to the
answer the non-streamed call gives (and records):

- text is decoded as the final answer is (control tokens dropped, cut at a stop string);
- held back: a tail that may still become a stop string, ``<think>`` or (when tools are
  offered) ``<tool_call>``; a trailing incomplete UTF-8 character (shown as U+FFFD); in
  chat, leading and trailing whitespace (the chat answer is stripped);
- once the text opens a ``<think>`` block or shows a tool call, nothing more is sent live:
  the reasoning, the rest of the content and the tool calls come with the final chunks.

Live chunks carry text only; the token ids and logprobs of the whole answer come on the last
content chunk (as for structured answers), so a forwarding gateway reading the stream records
the same call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["LiveText", "chat_live_chunk", "completion_live_chunk"]

_THINK = "<think>"
_TOOL_CALL = "<tool_call>"


class LiveText:
    """The safe-to-send text of a generation in progress (module docstring)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], *, chat: bool,
                 tools: bool, stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._chat = chat
        self._markers = tuple(stop) + ((_THINK,) + ((_TOOL_CALL,) if tools else ())
                                       if chat else ())
        self._stop = tuple(s for s in stop if s)
        self._ids: list[int] = []
        self.sent = ""
        self.structured = False

    def feed(self, token_id: int) -> str:
        """Take the next sampled id; the new text that can be sent now ("" when none)."""
        self._ids.append(int(token_id))
        if self.structured:
            return ""
        text = self._decode(self._ids)
        cut = min((text.find(s) for s in self._stop if s in text), default=-1)
        if cut >= 0:
            text = text[:cut]
        if self._chat:
            text = text.lstrip()
            if text.startswith(_THINK) or (_TOOL_CALL in self._markers and _TOOL_CALL in text):
                self.structured = True
                return ""
        end = len(text.rstrip("\ufffd"))  # bytes of a character still to come
        for marker in self._markers:
            for k in range(min(len(marker) - 1, end), 0, -1):
                if text[:end].endswith(marker[:k]):
                    end -= k
                    break
        if self._chat:
            end = len(text[:end].rstrip())
        if end <= len(self.sent) or not text.startswith(self.sent):
            return ""
        piece = text[len(self.sent):end]
        self.sent = text[:end]
        return piece


def chat_live_chunk(*, request_id: str, created: int, model: str, text: str
                    ) -> dict[str, Any]:
    """A ``chat.completion.chunk`` carrying ``text`` as content."""
    return {"id": request_id, "object": "chat.completion.chunk", "created": created,
            "model": model, "choices": [{"index": 0, "delta": {"content": text},
                                         "logprobs": None, "finish_reason": None}]}


def completion_live_chunk(*, request_id: str, created: int, model: str, text: str
                          ) -> dict[str, Any]:
    """A ``text_completion`` stream chunk carrying ``text``."""
    return {"id": request_id, "object": "text_completion", "created": created,
            "model": model, "choices": [{"index": 0, "text": text, "logprobs": None,
                                         "finish_reason": None}]}
