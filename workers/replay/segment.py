"""Cutting an engine's prompt ids into the request messages they render.

Works with any Hugging Face chat template, by rendering the template on message prefixes
(``apply_chat_template(..., tokenize=False)``) and comparing with the decoded prompt:

1. The prompt ids are decoded (``offsets.decode_with_offsets``); the text must be the
   rendering of all messages followed by the template's generation prompt, or by a
   generation prompt that extends it without a special token (template options such as
   Qwen3's ``enable_thinking=False`` prefill an empty think block). Otherwise the prompt is not a
   rendering of its messages (an unrecorded message, another template, other tokens):
   ``PromptMismatchError``.
2. Message ``k`` ends where the rendering of messages ``1..k`` stops agreeing with the prompt
   text (their longest common prefix). Text a template writes only after a final message
   (a tool turn's closing ``<|im_end|>`` that continues with another ``<tool_response>``
   when more tool messages follow) is thereby left out.
3. Templates that render earlier messages differently once later ones exist are detected
   and handled: when the prefix rendering stops agreeing before the message's own text (its
   content or the names of its tool calls) is complete, or before the previous message's
   end, the message is re-anchored: its text as rendered last (from its first anchor to its
   last) is looked up in the prompt after the previous message, and its end is where the
   rendering's remaining closing text stops agreeing. Qwen3 is the common case: it renders
   an empty ``<think></think>`` block into a final assistant turn but not into earlier ones,
   and strips the reasoning of assistant turns that precede the last user query.
   A message whose text cannot be found raises ``SegmentationError``; so does a segment that
   misses its message's text while the prompt holds it elsewhere, and a boundary that cuts
   through a message's text. Not detected: a template that rewrites a message only while it
   is the last one, and writes none of its text verbatim then (its text lands in the next
   segment).
4. Whitespace at the end of a segment belongs to the next one (the newline a ChatML template
   writes after ``<|im_end|>``): the engine stops generating at the end-of-turn token, so
   with this rule an assistant message in a later prompt covers the same text as the
   generation prompt plus the generated tokens of the call that produced it.
5. Character boundaries map to tokens: a token belongs to the segment in which it starts (a
   boundary inside a token snaps to that token's end). Tokens after the last message are the
   generation prompt.

Renders of message prefixes are cached per ``Segmenter``, so an episode whose calls share
their history renders each distinct prefix once.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from workers.replay.equality import PrefixInterner, content_text, tools_key
from workers.replay.errors import PromptMismatchError, SegmentationError
from workers.replay.offsets import decode_with_offsets

__all__ = ["Segmentation", "Segmenter", "common_prefix_length"]


def common_prefix_length(a: str, b: str, *, a_start: int = 0, b_start: int = 0) -> int:
    """Length of the longest common prefix of ``a[a_start:]`` and ``b[b_start:]``, found by
    comparing slices of doubling size (C-speed comparisons, no per-character Python loop)."""
    n = min(len(a) - a_start, len(b) - b_start)
    done = 0
    step = 64
    while done < n:
        size = min(step, n - done)
        if a[a_start + done:a_start + done + size] == b[b_start + done:b_start + done + size]:
            done += size
            step *= 2
            continue
        hi = done + size
        while hi - done > 1:
            mid = (done + hi) // 2
            if a[a_start + done:a_start + mid] == b[b_start + done:b_start + mid]:
                done = mid
            else:
                hi = mid
        return done
    return max(n, 0)


@dataclass(frozen=True)
class Segmentation:
    """A prompt cut into messages. ``text``: the decoded prompt. ``ends``: each message's
    end in ``text`` (characters). ``message_ids``: each message's token ids.
    ``generation_prompt_ids``: the tokens after the last message. ``relocated``: indices of
    messages that had to be re-anchored because the template rendered them (or an earlier
    message) differently as the final message."""

    text: str
    ends: list[int]
    message_ids: list[list[int]]
    generation_prompt_ids: list[int]
    relocated: list[int]


def _message_key(message: Mapping[str, Any]) -> str:
    return json.dumps(message, sort_keys=True, ensure_ascii=False, default=str)


def _anchor_pieces(message: Mapping[str, Any], rendered: str) -> list[str]:
    """Texts of ``message`` that ``rendered`` (a rendering ending with it) shows verbatim:
    its stripped content (or, when that is not shown, its last non-empty line) and the names
    of its tool calls, in rendering order."""
    pieces: list[str] = []
    content = content_text(message.get("content")).strip()
    if content:
        if rendered.rfind(content) >= 0:
            pieces.append(content)
        else:
            lines = [line.strip() for line in content.splitlines() if line.strip()]
            if lines and rendered.rfind(lines[-1]) >= 0:
                pieces.append(lines[-1])
    for call in message.get("tool_calls") or ():
        fn = call.get("function", call) if isinstance(call, Mapping) else None
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if isinstance(name, str) and name and rendered.rfind(name) >= 0:
            pieces.append(name)
    return pieces


def _body(rendered: str, pieces: list[str]) -> tuple[int, int] | None:
    """Span of the last message's own text in ``rendered``: first anchor to end of last."""
    if not pieces:
        return None
    last = pieces[-1]
    end = rendered.rfind(last)
    start = rendered.rfind(pieces[0], 0, end + len(last))
    if start < 0 or start > end:
        start = end
    return start, end + len(last)


def _own_texts(message: Mapping[str, Any]) -> list[str]:
    """The stripped content and tool call names of ``message``."""
    texts = [content_text(message.get("content")).strip()]
    for call in message.get("tool_calls") or ():
        fn = call.get("function", call) if isinstance(call, Mapping) else None
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if isinstance(name, str):
            texts.append(name)
    return [t for t in texts if len(t) > 1]


def _straddles(text: str, piece: str, cut: int) -> bool:
    """Whether an occurrence of ``piece`` in ``text`` begins before ``cut`` and ends after."""
    at = text.find(piece, max(0, cut - len(piece) + 1), cut + len(piece) - 1)
    return 0 <= at < cut


def _check_segment(text: str, start: int, end: int, message: Mapping[str, Any],
                   pieces: list[str], index: int, call_id: str | None) -> None:
    """Refuse a segment that misses its message's text or cuts through it."""
    for piece in pieces:
        if text.find(piece, start, end) < 0 and text.find(piece) >= 0:
            raise SegmentationError(
                f"message {index} ({message['role']}) text {piece[:60]!r} lies outside its "
                f"segment {_snippet(text[:end], start)}; the template renders it in a way "
                f"that cannot be segmented", message_index=index, call_id=call_id)
    for piece in _own_texts(message):
        for cut in (start, end):
            if _straddles(text, piece, cut):
                raise SegmentationError(
                    f"a segment boundary at character {cut} cuts through message {index} "
                    f"({message['role']}) text {piece[:60]!r}; the template renders it "
                    f"differently as the last message", message_index=index, call_id=call_id)


def _snippet(text: str, at: int) -> str:
    return repr(text[max(0, at - 30):at + 50])


class Segmenter:
    """Segments prompts of one episode with ``tokenizer`` and its chat template (or
    ``chat_template`` when given). Raises ValueError when neither gives a template."""

    def __init__(self, tokenizer: Any, *, chat_template: str | None = None) -> None:
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("tokenizer has no chat_template and no chat_template was given")
        if chat_template is not None and not isinstance(chat_template, str):
            raise TypeError(f"chat_template must be a string, got "
                            f"{type(chat_template).__name__}")
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self._interner = PrefixInterner()
        self._renders: dict[int, str] = {0: ""}
        self._parent_agreement: dict[int, int] = {}
        self._generation_prompts: set[str] = set()
        self._special_tokens: list[str] | None = None

    def render(self, messages: Sequence[Mapping[str, Any]], *,
               tools: Sequence[Mapping[str, Any]] | None, generation_prompt: bool) -> str:
        """The template's text for ``messages`` and ``tools``. Raises SegmentationError
        (naming the last message) when the template refuses them."""
        try:
            out = self.tokenizer.apply_chat_template(
                [dict(m) for m in messages],
                tools=[dict(t) for t in tools] if tools else None,
                tokenize=False,
                add_generation_prompt=generation_prompt,
                chat_template=self.chat_template,
            )
        except Exception as exc:  # the template's own raise_exception and Jinja errors
            raise SegmentationError(
                f"the chat template cannot render the first {len(messages)} messages: "
                f"{type(exc).__name__}: {exc}", message_index=len(messages) - 1) from exc
        if not isinstance(out, str):
            raise TypeError(f"apply_chat_template(tokenize=False) returned "
                            f"{type(out).__name__}, expected str")
        return out

    def _prefix_renders(self, messages: Sequence[Mapping[str, Any]],
                        tools: Sequence[Mapping[str, Any]] | None
                        ) -> tuple[list[str], list[int]]:
        """Renders of messages[:k] for k = 0..n and how far each agrees with the previous."""
        node = self._interner.root(tools_key(tools))
        renders = [""]
        agreement = [0]
        for k in range(1, len(messages) + 1):
            node = self._interner.child(node, _message_key(messages[k - 1]))
            text = self._renders.get(node)
            if text is None:
                text = self.render(messages[:k], tools=tools, generation_prompt=False)
                self._renders[node] = text
                self._parent_agreement[node] = common_prefix_length(renders[-1], text)
            renders.append(text)
            agreement.append(self._parent_agreement[node])
        return renders, agreement

    def segment(self, messages: Sequence[Mapping[str, Any]], *,
                tools: Sequence[Mapping[str, Any]] | None = None,
                prompt_ids: Sequence[int] | np.ndarray,
                call_id: str | None = None) -> Segmentation:
        """Cut ``prompt_ids`` into ``messages`` (see the module docstring). Raises TypeError
        when ``messages`` is not a non-empty list of mappings with a ``role``,
        PromptMismatchError when the ids are not a rendering of the messages and
        SegmentationError when a message cannot be placed."""
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) \
                or not messages:
            raise TypeError(f"messages must be a non-empty list of message mappings, got "
                            f"{messages!r:.80}")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
                raise TypeError(f"messages[{i}] must be a mapping with a string 'role', got "
                                f"{m!r:.80}")
        text, starts = decode_with_offsets(self.tokenizer, prompt_ids)
        renders, agreement = self._prefix_renders(messages, tools)
        self._check_rendering(text, renders[-1], messages, tools, call_id)
        ends: list[int] = []
        relocated: list[int] = []
        previous_end = 0
        agreed = 0  # common prefix length of renders[k - 1] and text
        for k in range(1, len(messages) + 1):
            rendered = renders[k]
            q = agreement[k]
            if agreed < q:
                pass  # renders[k] repeats renders[k-1]'s disagreement with the text
            elif q < agreed:
                agreed = q
            else:
                agreed = q + common_prefix_length(rendered, text, a_start=q, b_start=q)
            pieces = _anchor_pieces(messages[k - 1], rendered)
            body = _body(rendered, pieces)
            if agreed >= previous_end and (body is None or body[1] <= agreed):
                end = agreed
            else:
                end = self._relocate(text, rendered, body, previous_end, k - 1, call_id)
                relocated.append(k - 1)
            while end > previous_end and text[end - 1].isspace():
                end -= 1
            _check_segment(text, previous_end, end, messages[k - 1], pieces, k - 1, call_id)
            ends.append(end)
            previous_end = end
        cuts = np.searchsorted(starts, np.asarray([0, *ends], dtype=np.int64), side="left")
        ids = np.asarray(prompt_ids, dtype=np.int64).tolist()
        message_ids = [ids[int(cuts[i]):int(cuts[i + 1])] for i in range(len(ends))]
        return Segmentation(text=text, ends=ends, message_ids=message_ids,
                            generation_prompt_ids=ids[int(cuts[-1]):], relocated=relocated)

    def _check_rendering(self, text: str, rendered: str,
                         messages: Sequence[Mapping[str, Any]],
                         tools: Sequence[Mapping[str, Any]] | None, call_id: str | None) -> None:
        """Refuse prompt text that is not ``rendered`` followed by a generation prompt: the
        template's own, or one that extends it without a special token (template options such
        as Qwen3's ``enable_thinking=False`` prefill a block after it). Generation prompts
        accepted once are remembered, so most calls need no extra rendering."""
        suffix = text[len(rendered):] if text.startswith(rendered) else None
        if suffix is not None and suffix in self._generation_prompts:
            return
        with_prompt = self.render(messages, tools=tools, generation_prompt=True)
        expected = with_prompt[len(rendered):] if with_prompt.startswith(rendered) else None
        if text == with_prompt or (suffix is not None and expected is not None
                                   and suffix.startswith(expected)
                                   and not self._has_special_token(suffix[len(expected):])):
            if suffix is not None:
                self._generation_prompts.add(suffix)
            return
        at = common_prefix_length(text, with_prompt)
        raise PromptMismatchError(
            f"the prompt ids are not a rendering of the request messages: they decode to "
            f"{_snippet(text, at)} where the chat template gives {_snippet(with_prompt, at)} "
            f"(character {at})", call_id=call_id)

    def _has_special_token(self, text: str) -> bool:
        """Whether ``text`` holds one of the tokenizer's special tokens (turn delimiters such
        as ``<|im_start|>``): an extension holding one is a further turn, not an option."""
        if self._special_tokens is None:
            backend = getattr(self.tokenizer, "backend_tokenizer", None)
            added = backend.get_added_tokens_decoder().values() if backend is not None else ()
            self._special_tokens = [t.content for t in added if t.special and t.content]
        return any(token in text for token in self._special_tokens)

    @staticmethod
    def _relocate(text: str, rendered: str, body: tuple[int, int] | None, previous_end: int,
                  index: int, call_id: str | None) -> int:
        if body is None:
            raise SegmentationError(
                f"message {index} renders differently once later messages follow it and has "
                f"no text (content or tool call name) by which to find it in the prompt",
                message_index=index, call_id=call_id)
        own = rendered[body[0]:body[1]]
        at = text.find(own, previous_end)
        if at < 0:
            raise SegmentationError(
                f"message {index} renders differently once later messages follow it, and its "
                f"text {own[:60]!r} does not occur in the prompt after the previous message",
                message_index=index, call_id=call_id)
        after = at + len(own)
        return after + common_prefix_length(rendered, text, a_start=body[1], b_start=after)
