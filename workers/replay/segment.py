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
their history renders each distinct prefix once; renders go through ``render.ChatRenderer``
(the same text as ``apply_chat_template``, rendered faster).

Reuse across the calls of an episode. A call whose messages extend an earlier call's (same
tools, the earlier messages first) and whose prompt ids extend that call's prompt ids is
segmented from the earlier segmentation, with the result the steps above give:

- The earlier messages keep their segments. The steps above look at the prompt text only up
  to a horizon (the characters every comparison, search and check of those messages read);
  while the horizon lies within the earlier prompt, which the new prompt begins with, they
  give the same ends on the new prompt. A text of a message found nowhere in the earlier
  prompt must still be found nowhere in the new one (step 3's refusal). Otherwise, and
  whenever the prompt does not extend the earlier one token for token (a template that
  re-renders history, such as Qwen3 dropping the reasoning of assistant turns once a new
  user query follows), the call is segmented in full.
- Only the new tokens are decoded (byte-level tokenizers; others decode in full).
- The new messages are placed by steps 2-4 with renders of the new message prefixes, except
  for the last one: the prompt is its rendering followed by the generation prompt, so with
  the generation prompt of the earlier call (already accepted, step 1) the last rendering is
  the prompt text without it, and the call renders at most ``new messages - 1`` times (once
  for the usual reply + tool result). Such a rendering taken from the prompt is checked
  against the template by ``Segmenter.verify`` (rendering the last message list of every
  chain of calls, once per chain); ``replay_episode`` segments the episode in full when that
  check fails or when anything on the way raises, so that errors are those of the full path.
  A prompt extended by a later call is checked through that call: its text is the beginning
  of a prompt that is checked.

Reuse across episodes. A call segmented in full (an episode's first) is kept for the process,
per tokenizer and template, by its messages, tools and prompt ids: the episodes of a GRPO
group open with the same prompt, so only the first of them segments it, and the others take
a copy of that segmentation (the same deterministic result, ``FIRST_CALLS_KEPT`` kept).

Templates that read the clock. transformers gives templates ``strftime_now`` (Llama 3.x
writes today's date into its system block), so the same messages render another text on
another day. A call segmented in full renders with the clock its prompt was rendered with:
the messages are rendered once with a clock that writes markers, the prompt text is matched
against that rendering with each marker free, and what stands in the prompt at each marker is
what that format answers (``_recorded_clock``). A call that extends another keeps its clock;
the render cache is keyed by it. A prompt that no clock explains is refused by step 1 as any
other.

``Segmenter(tokenizer, reuse=False)`` segments every call in full.
"""

from __future__ import annotations

import dataclasses
import marshal
import re
import sys
import threading
import weakref
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import numpy as np

from workers.engines.render import ChatRenderer, RenderBudgetExceeded
from workers.replay.equality import PrefixInterner, content_text
from workers.replay.errors import PromptMismatchError, ReplayError, SegmentationError
from workers.replay.offsets import IdDecoder

__all__ = ["Segmentation", "Segmenter", "common_prefix_length"]


def common_prefix_length(a: str, b: str, *, a_start: int = 0, b_start: int = 0,
                         likely: int = 0) -> int:
    """Length of the longest common prefix of ``a[a_start:]`` and ``b[b_start:]``, found by
    comparing slices of doubling size (C-speed comparisons, no per-character Python loop).
    ``likely``: a length the prefix probably reaches (the history two renderings share),
    compared first in one piece."""
    n = min(len(a) - a_start, len(b) - b_start)
    # The usual case, a rendering that the prompt text begins with: one comparison, no slices.
    if n > 0 and ((a_start == 0 and len(a) == n and b.startswith(a, b_start))
                  or (b_start == 0 and len(b) == n and a.startswith(b, a_start))):
        return n
    done = 0
    if 0 < likely <= n and a[a_start:a_start + likely] == b[b_start:b_start + likely]:
        done = likely
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
    #: This segmentation's number in its ``Segmenter``; ``base``: the number of the earlier
    #: one whose first ``reused`` messages (same segments, same id lists) it took over.
    key: int = 0
    base: int | None = None
    reused: int = 0


def _render_key(value: Any) -> bytes | str:
    """The key of a message (or a tool list) in the render cache: equal exactly when the two
    hold the same values of the same types in the same order, which is all a template can
    see of them (key order included: a template that loops over a message's items renders
    them in order). ``marshal`` format 0 (no shared references, so a function of the value
    alone) for plain JSON-like data, a third of the cost of a ``repr``; the ``repr`` of
    anything marshal refuses."""
    try:
        return marshal.dumps(value, 0)
    except ValueError:
        return repr(value)


def _texts_of(message: Mapping[str, Any]) -> tuple[str, list[str]]:
    """The stripped content of ``message`` and the names of its tool calls (the string
    ones, in order)."""
    names: list[str] = []
    for call in message.get("tool_calls") or ():
        fn = call.get("function", call) if isinstance(call, Mapping) else None
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if isinstance(name, str):
            names.append(name)
    return content_text(message.get("content")).strip(), names


def _anchor_pieces(content: str, names: list[str], rendered: str) -> list[str]:
    """Texts of a message (its ``_texts_of``) that ``rendered`` (a rendering ending with
    it) shows verbatim: its stripped content (or, when that is not shown, its last non-empty
    line) and the names of its tool calls, in rendering order."""
    pieces: list[str] = []
    if content:
        if rendered.rfind(content) >= 0:
            pieces.append(content)
        else:
            lines = [line.strip() for line in content.splitlines() if line.strip()]
            if lines and rendered.rfind(lines[-1]) >= 0:
                pieces.append(lines[-1])
    for name in names:
        if name and rendered.rfind(name) >= 0:
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


def _straddles(text: str, piece: str, cut: int) -> bool:
    """Whether an occurrence of ``piece`` in ``text`` begins before ``cut`` and ends after."""
    at = text.find(piece, max(0, cut - len(piece) + 1), cut + len(piece) - 1)
    return 0 <= at < cut


#: A horizon that reaches the end of the text: what lies after it could change the result.
_OPEN = sys.maxsize


def _agreement(rendered: str, text: str, *, r_start: int = 0, t_start: int = 0,
               likely: int = 0) -> tuple[int, int]:
    """``common_prefix_length`` of ``rendered[r_start:]`` and ``text[t_start:]``, and how far
    into ``text`` the answer depends on it: up to the first differing character, up to where
    ``rendered`` ran out, or ``_OPEN`` when ``text`` ran out first."""
    length = common_prefix_length(rendered, text, a_start=r_start, b_start=t_start,
                                  likely=likely)
    at = t_start + length
    if at >= len(text):
        return length, _OPEN
    if r_start + length >= len(rendered):
        return length, at
    return length, at + 1


def _check_segment(text: str, start: int, end: int, message: Mapping[str, Any],
                   pieces: list[str], own: list[str], index: int, call_id: str | None
                   ) -> tuple[list[str], list[tuple[int, str]], int]:
    """Refuse a segment that misses its message's text or cuts through it (``own``: its
    stripped content and tool call names longer than one character). Returns the
    message's texts found nowhere in ``text`` (a longer text holding one would be refused),
    the (boundary, text) checks that a longer text could fail (an occurrence crossing the
    end of ``text``), and how far into ``text`` the other checks read."""
    absent: list[str] = []
    unsettled: list[tuple[int, str]] = []
    horizon = end
    for piece in pieces:
        if text.find(piece, start, end) < 0:
            if text.find(piece) >= 0:
                raise SegmentationError(
                    f"message {index} ({message['role']}) text {piece[:60]!r} lies outside "
                    f"its segment {_snippet(text[:end], start)}; the template renders it in a "
                    f"way that cannot be segmented", message_index=index, call_id=call_id)
            absent.append(piece)
    for piece in own:
        for cut in (start, end):
            if cut + len(piece) - 1 > len(text):
                unsettled.append((cut, piece))
            if _straddles(text, piece, cut):
                raise SegmentationError(
                    f"a segment boundary at character {cut} cuts through message {index} "
                    f"({message['role']}) text {piece[:60]!r}; the template renders it "
                    f"differently as the last message", message_index=index, call_id=call_id)
    return absent, unsettled, horizon


def _snippet(text: str, at: int) -> str:
    return repr(text[max(0, at - 30):at + 50])


#: Generation prompts accepted for a chat template (step 1), by (the tokenizer's templates,
#: the override): shared by the Segmenters of a process, so that an episode's first call
#: needs no extra rendering either once one episode of the run has been segmented.
_ACCEPTED: dict[tuple[str, str | None], set[str]] = {}
_ACCEPTED_LOCK = threading.Lock()


def _accepted_generation_prompts(templates: str, override: str | None) -> set[str]:
    with _ACCEPTED_LOCK:
        return _ACCEPTED.setdefault((templates, override), set())


#: What ``strftime_now`` answered when a prompt was rendered: (format, text) pairs, sorted.
Clock = tuple[tuple[str, str], ...]
_MARK = re.compile("\ue000(\\d+)\ue001")
#: Longest text one ``strftime_now`` call is taken to have written.
_CLOCK_TEXT = 200


def _cannot_render(exc: Exception, count: int) -> SegmentationError:
    """The error of a template that refused (or ran out of budget on) ``count`` messages;
    raise it ``from exc`` (a render budget's error is recognised by its cause)."""
    return SegmentationError(f"the chat template cannot render the first {count} messages: "
                             f"{type(exc).__name__}: {exc}", message_index=count - 1)


def _clock_function(clock: Clock) -> Callable[[str], str]:
    """``strftime_now`` answering as ``clock`` recorded (a format it did not record: the
    current time's, as transformers' own)."""
    recorded = dict(clock)

    def strftime_now(format: str) -> str:
        found = recorded.get(format)
        return found if found is not None else datetime.now().strftime(format)
    return strftime_now


def _recorded_clock(renderer: ChatRenderer, messages: Sequence[Mapping[str, Any]],
                    tools: Sequence[Mapping[str, Any]] | None, text: str) -> Clock | None:
    """What the template's ``strftime_now`` wrote into the prompt ``text`` (a Llama 3.x
    system block's date): the messages are rendered with a clock that writes a marker, and
    the prompt is matched against that rendering with each marker free. None when the
    template writes no clock text, or when the prompt is no rendering of the messages (the
    full check says why)."""
    formats: list[str] = []

    def mark(format: str) -> str:
        formats.append(str(format))
        return f"\ue000{len(formats) - 1}\ue001"
    try:
        rendered = renderer.render(messages, tools=tools, generation_prompt=False, clock=mark)
    except RenderBudgetExceeded as exc:  # another render would spend the budget again
        raise _cannot_render(exc, len(messages)) from exc
    except Exception:  # the template's own errors: the full path reports them
        return None
    parts = _MARK.split(rendered) if isinstance(rendered, str) else []
    if len(parts) < 2:
        return None
    pattern = "".join(re.escape(part) if i % 2 == 0 else f"(.{{0,{_CLOCK_TEXT}}}?)"
                      for i, part in enumerate(parts))
    found = re.compile(pattern, re.DOTALL).match(text)
    if found is None:
        return None
    clock: dict[str, str] = {}
    for group, index in enumerate(parts[1::2], start=1):
        clock.setdefault(formats[int(index)], found.group(group))
    return tuple(sorted(clock.items()))


@dataclass
class _Done:
    """What a segmentation leaves for a later call that extends it."""

    key: int
    messages: list[Mapping[str, Any]]
    tools: list[Mapping[str, Any]]
    tools_key: bytes | str
    ids: np.ndarray
    text: str
    #: Each token's start in ``text``: the first ``len(ids)`` entries of a list that the
    #: segmentations extending this one may share, each appending its own tokens' starts
    #: (a list someone appended to already is copied first).
    starts: list[int]
    appendable: bool
    ends: list[int]
    relocated: list[int]
    message_ids: list[list[int]]
    #: How far into ``text`` the placing of the messages read (``_OPEN``: to its end).
    horizon: int
    #: Texts of the messages found nowhere in ``text``.
    absent: list[str]
    #: Boundary checks that an occurrence crossing the end of ``text`` could fail.
    unsettled: list[tuple[int, str]]
    #: The generation prompt: ``text`` after the last message's rendering.
    suffix: str
    #: Interned id of the message list (prefix renders of later calls hang below it).
    node: int
    #: The last message's rendering when taken from the prompt instead of the template.
    derived: str | None = None
    extended: bool = field(default=False)
    #: The clock the prompt was rendered with (``_recorded_clock``; None: the template
    #: reads none).
    clock: Clock | None = None


#: Calls segmented in full, per tokenizer: (templates, override, tools, messages, ids) ->
#: the segmentation's state (see the module docstring). Entries are never handed out
#: themselves, only copies, since a Segmenter marks its own state as extended.
_FIRST_CALLS: weakref.WeakKeyDictionary[Any, OrderedDict[tuple[Any, ...], _Done]] = \
    weakref.WeakKeyDictionary()
_FIRST_CALLS_LOCK = threading.Lock()
#: Full segmentations kept per tokenizer (the openings of the groups being replayed).
FIRST_CALLS_KEPT = 256


@dataclass
class _Placed:
    ends: list[int]
    relocated: list[int]
    absent: list[str]
    unsettled: list[tuple[int, str]]
    horizon: int


class Segmenter:
    """Segments prompts of one episode with ``tokenizer`` and its chat template (or
    ``chat_template`` when given), reusing earlier segmentations of the episode's calls
    unless ``reuse`` is False (see the module docstring); ``owner``: the run's project, whose
    renders past the budget mark it struck (``render.ChatRenderer``). Raises ValueError when
    neither gives a template."""

    #: Earlier segmentations kept for calls that extend them (agents of an episode take
    #: turns, so a call usually extends one of the last few).
    KEEP = 8

    def __init__(self, tokenizer: Any, *, chat_template: str | None = None,
                 reuse: bool = True, owner: str | None = None) -> None:
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("tokenizer has no chat_template and no chat_template was given")
        if chat_template is not None and not isinstance(chat_template, str):
            raise TypeError(f"chat_template must be a string, got "
                            f"{type(chat_template).__name__}")
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.reuse = reuse
        self._renderer = ChatRenderer(tokenizer, chat_template=chat_template, owner=owner)
        self._decode = IdDecoder(tokenizer)
        self._interner = PrefixInterner()
        self._renders: dict[int, str] = {0: ""}
        templates = getattr(tokenizer, "chat_template", None)
        self._template_key = (templates if isinstance(templates, str) else repr(templates),
                              chat_template)
        self._generation_prompts = _accepted_generation_prompts(*self._template_key)
        self._special_tokens: list[str] | None = None
        #: The clock of the call being segmented (``_Done.clock``).
        self._clock: Clock | None = None
        self._done: list[_Done] = []
        self._derived: list[_Done] = []
        self._count = 0
        #: Room for callers to keep what they built from a segmentation, by its ``key``
        #: (``initial`` keeps the timeline messages a later call reuses).
        self.memo: dict[int, Any] = {}

    def render(self, messages: Sequence[Mapping[str, Any]], *,
               tools: Sequence[Mapping[str, Any]] | None, generation_prompt: bool) -> str:
        """The template's text for ``messages`` and ``tools``. Raises SegmentationError
        (naming the last message) when the template refuses them."""
        clock = _clock_function(self._clock) if self._clock else None
        try:
            out = self._renderer.render(messages, tools=tools,
                                        generation_prompt=generation_prompt, clock=clock)
        except Exception as exc:  # the template's own raise_exception and Jinja errors
            raise _cannot_render(exc, len(messages)) from exc
        if not isinstance(out, str):
            raise TypeError(f"apply_chat_template(tokenize=False) returned "
                            f"{type(out).__name__}, expected str")
        return out

    def _prefix_render(self, node: int, messages: Sequence[Mapping[str, Any]],
                       tools: Sequence[Mapping[str, Any]] | None) -> str:
        text = self._renders.get(node)
        if text is None:
            text = self.render(messages, tools=tools, generation_prompt=False)
            self._renders[node] = text
        return text

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
            if not (type(m) is dict or isinstance(m, Mapping)) \
                    or not isinstance(m.get("role"), str):
                raise TypeError(f"messages[{i}] must be a mapping with a string 'role', got "
                                f"{m!r:.80}")
        ids = np.asarray(prompt_ids)
        if ids.ndim == 1 and (ids.size == 0 or ids.dtype.kind in "iu"):
            ids = ids.astype(np.int64, copy=False)
        tools_key_ = _render_key(list(tools or ()))
        if self.reuse:
            base = self._base(messages, tools_key_, ids)
            if base is not None:
                try:
                    done = self._extend(base, messages, tools, ids, call_id)
                except ReplayError:
                    done = None  # the full path says what is wrong
                if done is not None:
                    return self._finish(done, base)
        return self._finish(self._full_shared(messages, tools, tools_key_, ids, call_id), None)

    def _base(self, messages: Sequence[Mapping[str, Any]], tools_key_: bytes | str, ids: np.ndarray
              ) -> _Done | None:
        """The latest earlier segmentation that this call extends (see the module
        docstring), if any."""
        for done in reversed(self._done):
            n = len(done.messages)
            if (done.appendable and done.horizon <= len(done.text) and done.suffix
                    and len(messages) > n and done.tools_key == tools_key_
                    and ids.ndim == 1 and len(ids) > len(done.ids)
                    and ids[:len(done.ids)].tobytes() == done.ids.tobytes()
                    and list(messages[:n]) == done.messages):
                return done
        return None

    def _finish(self, done: _Done, base: _Done | None) -> Segmentation:
        if self.reuse:
            if base is not None:
                base.extended = True
            self._done.append(done)
            del self._done[:-self.KEEP]
            if done.derived is not None:
                self._derived.append(done)
        reused = len(base.messages) if base is not None else 0
        # Token boundaries of the messages not taken over (ends never decrease): only their
        # tokens and the generation prompt's become new lists.
        first = done.ends[reused - 1] if reused else 0
        count = len(done.ids)
        cuts = [bisect_left(done.starts, end, 0, count) for end in (first, *done.ends[reused:])]
        low = cuts[0]
        ids = done.ids[low:].tolist()
        message_ids = list(base.message_ids) if base is not None else []
        for i in range(len(cuts) - 1):
            message_ids.append(ids[cuts[i] - low:cuts[i + 1] - low])
        done.message_ids = message_ids
        # A frozen dataclass's __init__ sets each field through object.__setattr__.
        out = object.__new__(Segmentation)
        out.__dict__.update(text=done.text, ends=done.ends, message_ids=message_ids,
                            generation_prompt_ids=ids[cuts[-1] - low:],
                            relocated=done.relocated,
                            key=done.key, base=base.key if base is not None else None,
                            reused=reused)
        return out

    def _new_key(self) -> int:
        self._count += 1
        return self._count

    def _full_shared(self, messages: Sequence[Mapping[str, Any]],
                     tools: Sequence[Mapping[str, Any]] | None, tools_key_: bytes | str,
                     ids: np.ndarray, call_id: str | None) -> _Done:
        """``_full``, or a copy of the same call segmented in full by another Segmenter of
        this tokenizer and template (see the module docstring)."""
        key: tuple[Any, ...] | None = None
        cache = None
        if self.reuse and ids.ndim == 1 and ids.dtype == np.int64:
            try:
                key = (*self._template_key, tools_key_, marshal.dumps(list(messages), 0),
                       ids.tobytes())
            except ValueError:  # messages of types marshal refuses: no key for them
                key = None
        if key is not None:
            with _FIRST_CALLS_LOCK:
                try:
                    cache = _FIRST_CALLS.setdefault(self.tokenizer, OrderedDict())
                except TypeError:  # a tokenizer that cannot be weakly referenced
                    cache = None
                hit = cache.get(key) if cache is not None else None
                if hit is not None and cache is not None:
                    cache.move_to_end(key)
            if hit is not None:
                self._clock = hit.clock
                node = self._interner.root(self._root_key(tools_key_))
                for message in messages:
                    node = self._interner.child(node, _render_key(message))
                return dataclasses.replace(
                    hit, key=self._new_key(), messages=list(messages), tools=list(tools or ()),
                    ids=ids, starts=list(hit.starts), message_ids=[], node=node, derived=None,
                    extended=False)
        done = self._full(messages, tools, tools_key_, ids, call_id)
        if key is not None and cache is not None:
            with _FIRST_CALLS_LOCK:
                cache[key] = dataclasses.replace(done, starts=list(done.starts))
                while len(cache) > FIRST_CALLS_KEPT:
                    cache.popitem(last=False)
        return done

    def _full(self, messages: Sequence[Mapping[str, Any]],
              tools: Sequence[Mapping[str, Any]] | None, tools_key_: bytes | str, ids: np.ndarray,
              call_id: str | None) -> _Done:
        text, starts, appendable = self._decode(ids.tolist())
        self._clock = (_recorded_clock(self._renderer, messages, tools, text)
                       if self._renderer.reads_clock(tools=bool(tools)) else None)
        node = self._interner.root(self._root_key(tools_key_))
        renders: list[str] = []
        for k in range(1, len(messages) + 1):
            node = self._interner.child(node, _render_key(messages[k - 1]))
            renders.append(self._prefix_render(node, messages[:k], tools))
        suffix = self._check_rendering(text, renders[-1], messages, tools, call_id)
        placed = self._place(text, messages, renders, first=0, previous_end=0,
                             horizon=0, call_id=call_id)
        return _Done(key=self._new_key(), messages=list(messages), tools=list(tools or ()),
                     tools_key=tools_key_, ids=ids, text=text, starts=starts,
                     appendable=appendable, ends=placed.ends, relocated=placed.relocated,
                     message_ids=[], horizon=placed.horizon, absent=placed.absent,
                     unsettled=placed.unsettled, suffix=suffix, node=node, clock=self._clock)

    def _root_key(self, tools_key_: bytes | str) -> Any:
        """The render cache's root for a call: its tools, and its clock when it has one
        (the same messages render another date under another clock)."""
        return tools_key_ if self._clock is None else (tools_key_, self._clock)

    def _extend(self, base: _Done, messages: Sequence[Mapping[str, Any]],
                tools: Sequence[Mapping[str, Any]] | None, ids: np.ndarray,
                call_id: str | None) -> _Done | None:
        """Segment a call that extends ``base``; None when it must be segmented in full."""
        added, added_starts, appendable = self._decode(ids[len(base.ids):].tolist())
        if not appendable:
            return None
        self._clock = base.clock
        text = base.text + added
        for piece in base.absent:
            if text.find(piece, max(0, len(base.text) - len(piece) + 1)) >= 0:
                return None
        if any(_straddles(text, piece, cut) for cut, piece in base.unsettled):
            return None
        if not text.endswith(base.suffix) or any(
                len(other) > len(base.suffix) and text.endswith(other)
                for other in self._generation_prompts):
            return None
        last = text[:len(text) - len(base.suffix)]
        n, m = len(messages), len(base.messages)
        if len(last) < base.ends[-1]:
            return None
        node = base.node
        renders: list[str] = []
        for k in range(m + 1, n + 1):
            node = self._interner.child(node, _render_key(messages[k - 1]))
            renders.append(last if k == n else self._prefix_render(node, messages[:k], tools))
        placed = self._place(text, messages, renders, first=m, previous_end=base.ends[-1],
                             horizon=base.horizon, call_id=call_id)
        starts = base.starts
        if len(starts) != len(base.ids):  # another call extended it: this one forks
            starts = starts[:len(base.ids)]
        offset = len(base.text)
        starts.extend([start + offset for start in added_starts])
        return _Done(key=self._new_key(), messages=list(messages), tools=base.tools,
                     tools_key=base.tools_key, ids=ids, text=text, starts=starts,
                     appendable=True, ends=base.ends + placed.ends,
                     relocated=base.relocated + placed.relocated, message_ids=[],
                     horizon=placed.horizon, absent=base.absent + placed.absent,
                     unsettled=[(cut, piece) for cut, piece in base.unsettled
                                if cut + len(piece) - 1 > len(text)] + placed.unsettled,
                     suffix=base.suffix, node=node, derived=last, clock=base.clock)

    def verify(self) -> bool:
        """Whether every last-message rendering taken from a prompt (see the module
        docstring) is the template's own, checked for the calls no later call extended (one
        render each). False when one differs or the template refuses the messages."""
        for done in self._derived:
            if done.extended:
                continue
            self._clock = done.clock
            try:
                real = self.render(done.messages, tools=done.tools or None,
                                   generation_prompt=False)
            except SegmentationError:
                return False
            if real != done.derived:
                return False
        return True

    def _place(self, text: str, messages: Sequence[Mapping[str, Any]], renders: list[str], *,
               first: int, previous_end: int, horizon: int, call_id: str | None) -> _Placed:
        """Steps 2-4 for ``messages[first:]`` (``renders``: their prefix renderings), the
        earlier messages ending at ``previous_end``."""
        ends: list[int] = []
        relocated: list[int] = []
        absent: list[str] = []
        unsettled: list[tuple[int, str]] = []
        for index, rendered in enumerate(renders, start=first):
            message = messages[index]
            agreed, reach = _agreement(rendered, text, likely=previous_end)
            horizon = max(horizon, reach)
            content, names = _texts_of(message)
            pieces = _anchor_pieces(content, names, rendered)
            body = _body(rendered, pieces)
            if agreed >= previous_end and (body is None or body[1] <= agreed):
                end = agreed
            else:
                end, reach = self._relocate(text, rendered, body, previous_end, index, call_id)
                horizon = max(horizon, reach)
                relocated.append(index)
            while end > previous_end and text[end - 1].isspace():
                end -= 1
            own = [t for t in (content, *names) if len(t) > 1]
            missing, open_checks, reach = _check_segment(text, previous_end, end, message,
                                                         pieces, own, index, call_id)
            absent.extend(missing)
            unsettled.extend(open_checks)
            horizon = max(horizon, reach)
            ends.append(end)
            previous_end = end
        return _Placed(ends=ends, relocated=relocated, absent=absent, unsettled=unsettled,
                       horizon=horizon)

    def _check_rendering(self, text: str, rendered: str,
                         messages: Sequence[Mapping[str, Any]],
                         tools: Sequence[Mapping[str, Any]] | None, call_id: str | None) -> str:
        """Refuse prompt text that is not ``rendered`` followed by a generation prompt: the
        template's own, or one that extends it without a special token (template options such
        as Qwen3's ``enable_thinking=False`` prefill a block after it). Generation prompts
        accepted once are remembered (per template, for the process), so most calls need no
        extra rendering. Returns the generation prompt."""
        suffix = text[len(rendered):] if text.startswith(rendered) else None
        if suffix is not None and suffix in self._generation_prompts:
            return suffix
        with_prompt = self.render(messages, tools=tools, generation_prompt=True)
        expected = with_prompt[len(rendered):] if with_prompt.startswith(rendered) else None
        if text == with_prompt or (suffix is not None and expected is not None
                                   and suffix.startswith(expected)
                                   and not self._has_special_token(suffix[len(expected):])):
            if suffix is not None:
                self._generation_prompts.add(suffix)
                return suffix
            return ""
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
                  index: int, call_id: str | None) -> tuple[int, int]:
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
        length, reach = _agreement(rendered, text, r_start=body[1], t_start=after)
        return after + length, max(reach, after)
