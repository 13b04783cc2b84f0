"""Timelines and their merging (AgentJet's timeline merging, with the project's decisions).

A timeline is what one agent's LLM call saw and produced: its request messages, each carrying
its tokens of the prompt, then the generated message. ``merge_timelines`` folds timelines
that are prefixes of longer ones into them, so that one episode gives as few training samples
as possible without losing a sampled token:

- timelines of different agents never merge;
- ``T_i`` merges into ``T_j`` when ``len(T_i) <= len(T_j)`` and the first ``len(T_i)``
  messages are equal (text level: role, content, tool calls; token level: token ids), and,
  with ``ignore_tools=False``, their tool lists are equal;
- the absorber is the greatest timeline, ordered by ``(length, recording order)``, that the
  timeline merges into, so the outcome does not depend on which call finished first and an
  identical duplicate keeps the later one;
- absorbing copies author, tokens, logprobs, ``sampled`` and ``truncated`` of each ``llm``
  message into the survivor where the survivor's message is not already the model's own;
- the timelines of discarded calls (rolled back or abandoned, given as ``discarded``) take
  no part: they neither absorb nor are absorbed, so wherever their output appears in a
  survivor it stays context.

Merging runs in time linear in the total number of messages and tokens: every message prefix
is interned to an integer, and a dict from prefix id to the greatest timeline holding that
prefix gives each timeline's absorber with one lookup.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from workers.replay.equality import PrefixInterner, message_key, tools_key

__all__ = [
    "DEFAULT_POLICY",
    "LLM_AUTHOR",
    "MergeOutcome",
    "MergePolicy",
    "Message",
    "Timeline",
    "loss_mask",
    "merge_timelines",
    "plan_merge",
    "prefix_ids",
]

#: The author of the model's own output.
LLM_AUTHOR = "llm"


def _int_list(value: Any, name: str) -> list[int]:
    """``value`` as a new list of Python ints; refuses anything but a 1-d integer sequence."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or (value.size and value.dtype.kind not in "iu"):
            raise TypeError(f"{name} must be a 1-d integer array, got shape {value.shape} "
                            f"dtype {value.dtype}")
        return value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a sequence of integers, got {type(value).__name__}")
    out = list(value)
    if set(map(type, out)) <= {int}:  # the common case, checked at C speed
        return out
    for i, v in enumerate(out):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{name}[{i}] must be an integer, got {v!r}")
    return [int(v) for v in out]


def _float_list(value: Any, name: str) -> list[float]:
    """``value`` as a new list of Python floats; refuses anything but a 1-d number sequence."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or (value.size and value.dtype.kind not in "iuf"):
            raise TypeError(f"{name} must be a 1-d numeric array, got shape {value.shape} "
                            f"dtype {value.dtype}")
        return value.astype(np.float64).tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a sequence of numbers, got {type(value).__name__}")
    out = list(value)
    kinds = set(map(type, out))
    if kinds <= {float}:  # the common case, checked at C speed
        return out
    if kinds <= {float, int}:
        return [float(v) for v in out]
    for i, v in enumerate(out):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.floating,
                                                                  np.integer)):
            raise TypeError(f"{name}[{i}] must be a number, got {v!r}")
    return [float(v) for v in out]


def _tool_calls(value: Any) -> list[dict[str, Any]] | None:
    """``Message.tool_calls`` as stored: None, or a new list of new dicts. Raises TypeError
    when ``value`` is not a list of mappings."""
    if value is None:
        return None
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise TypeError(f"Message.tool_calls must be a list of mappings, got "
                        f"{type(value).__name__}")
    for i, call in enumerate(value):
        if not isinstance(call, Mapping):
            raise TypeError(f"Message.tool_calls[{i}] must be a mapping, got "
                            f"{type(call).__name__}")
    return [dict(c) for c in value]


def _check_agent(value: Any, name: str) -> None:
    """Refuse an agent name that is not a non-empty string (TypeError naming ``name``)."""
    if not isinstance(value, str) or not value:
        raise TypeError(f"{name} must be a non-empty string, got {value!r}")


def _tool_list(value: Any, name: str) -> list[dict[str, Any]] | None:
    """A timeline's tools as stored: None, or a new list of new dicts. Raises TypeError
    (naming ``name``) when ``value`` is not a sequence."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a list of tool schemas or None, got "
                        f"{type(value).__name__}")
    return [dict(t) for t in value]


@dataclass(frozen=True)
class Message:
    """One message of a timeline.

    ``role``: the chat role (``system``, ``user``, ``assistant``, ``tool``…). ``author``:
    ``"llm"`` for the model's own output, anything else (``env``, ``user``, ``tool``) for
    context. ``text``: the content. ``token_ids``: this message's tokens. ``logprobs``: one per
    token (0.0 where not sampled), or ``None`` for all 0.0. ``tool_calls``: OpenAI-format calls.
    ``truncated``: the generation was cut off (finish reason ``length``). ``sampled``: per-token
    0/1, 1 where the model sampled the token; ``None`` means every token of an ``llm`` message
    was sampled (and none of any other message).

    Raises TypeError for fields of the wrong type and ValueError for ``logprobs`` or
    ``sampled`` whose length differs from ``token_ids`` or ``sampled`` values other than 0/1.
    """

    role: str
    author: str
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    tool_calls: list[dict[str, Any]] | None = None
    truncated: bool = False
    sampled: list[int] | None = None

    def __post_init__(self) -> None:
        for name in ("role", "author"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise TypeError(f"Message.{name} must be a non-empty string, got {value!r}")
        if not isinstance(self.text, str):
            raise TypeError(f"Message.text must be a string, got {type(self.text).__name__}")
        ids = _int_list(self.token_ids, "Message.token_ids")
        object.__setattr__(self, "token_ids", ids)
        if self.logprobs is not None:
            lps = _float_list(self.logprobs, "Message.logprobs")
            if len(lps) != len(ids):
                raise ValueError(f"Message.logprobs has {len(lps)} entries but token_ids has "
                                 f"{len(ids)}")
            object.__setattr__(self, "logprobs", lps)
        if self.sampled is not None:
            mask = _int_list(self.sampled, "Message.sampled")
            if len(mask) != len(ids):
                raise ValueError(f"Message.sampled has {len(mask)} entries but token_ids has "
                                 f"{len(ids)}")
            if not set(mask) <= {0, 1}:
                bad = next(v for v in mask if v not in (0, 1))
                raise ValueError(f"Message.sampled must hold only 0 and 1, got {bad}")
            object.__setattr__(self, "sampled", mask)
        object.__setattr__(self, "tool_calls", _tool_calls(self.tool_calls))
        if not isinstance(self.truncated, bool):
            raise TypeError(f"Message.truncated must be a bool, got {self.truncated!r}")

    @classmethod
    def _built(cls, role: str, author: str, text: str, token_ids: list[int],
               logprobs: list[float] | None, tool_calls: Any = None, truncated: bool = False,
               sampled: list[int] | None = None) -> Message:
        """A message from fields already in the form ``__post_init__`` leaves them in (new
        lists of Python ints and floats of matching lengths, non-empty strings, a bool),
        without checking them again: for messages the replay builds itself from values it
        has checked. ``tool_calls`` is checked and copied as always."""
        message = object.__new__(cls)
        message.__dict__.update(role=role, author=author, text=text, token_ids=token_ids,
                                logprobs=logprobs, tool_calls=_tool_calls(tool_calls),
                                truncated=truncated, sampled=sampled)
        return message

    @property
    def is_llm(self) -> bool:
        """Whether the model wrote this message."""
        return self.author == LLM_AUTHOR

    def sampled_mask(self) -> list[int]:
        """Per-token 1 where the model sampled the token, else 0."""
        if self.sampled is not None:
            return list(self.sampled) if self.is_llm else [0] * len(self.token_ids)
        return [1 if self.is_llm else 0] * len(self.token_ids)

    def token_logprobs(self) -> list[float]:
        """Per-token rollout logprob where sampled, 0.0 elsewhere."""
        if self.logprobs is None or not self.is_llm:
            return [0.0] * len(self.token_ids)
        if self.sampled is None:
            return list(self.logprobs)
        return [lp if m else 0.0 for lp, m in zip(self.logprobs, self.sampled_mask(), strict=True)]


@dataclass(frozen=True)
class Timeline:
    """One agent's view of a conversation: ``messages`` in order (the last is usually the
    generated one) and the ``tools`` offered. Raises TypeError when ``agent`` is not a
    non-empty string or a message is not a ``Message``, ValueError when ``messages`` is
    empty."""

    agent: str
    messages: list[Message]
    tools: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        _check_agent(self.agent, "Timeline.agent")
        if isinstance(self.messages, (str, bytes)) or not isinstance(self.messages, Sequence):
            raise TypeError(f"Timeline.messages must be a list of Message, got "
                            f"{type(self.messages).__name__}")
        msgs = list(self.messages)
        if not msgs:
            raise ValueError("Timeline.messages must not be empty")
        for i, m in enumerate(msgs):
            if not isinstance(m, Message):
                raise TypeError(f"Timeline.messages[{i}] must be a Message, got "
                                f"{type(m).__name__}")
        object.__setattr__(self, "messages", msgs)
        object.__setattr__(self, "tools", _tool_list(self.tools, "Timeline.tools"))

    @classmethod
    def _built(cls, agent: str, messages: list[Message],
               tools: list[dict[str, Any]] | None) -> Timeline:
        """A timeline from fields already in the form ``__post_init__`` leaves them in (a
        non-empty string, a new non-empty list of ``Message``, new tool dicts or None),
        without checking or copying them again: for timelines the replay builds itself."""
        timeline = object.__new__(cls)
        timeline.__dict__.update(agent=agent, messages=messages, tools=tools)
        return timeline

    def __len__(self) -> int:
        return len(self.messages)

    @property
    def token_ids(self) -> list[int]:
        """All tokens, messages concatenated in order."""
        out: list[int] = []
        for m in self.messages:
            out.extend(m.token_ids)
        return out


def loss_mask(timeline: Timeline) -> list[int]:
    """The loss mask over ``timeline``'s concatenated tokens: 1 exactly on the tokens the
    model sampled (``llm`` messages, where ``sampled`` says so), 0 on every other token.
    Raises TypeError when ``timeline`` is not a ``Timeline``."""
    if not isinstance(timeline, Timeline):
        raise TypeError(f"timeline must be a Timeline, got {type(timeline).__name__}")
    out: list[int] = []
    for m in timeline.messages:
        out.extend(m.sampled_mask())
    return out


@dataclass(frozen=True)
class MergePolicy:
    """How timelines are compared. ``compare_level``: ``"text"`` (role, content and tool
    calls equal; the default, which also repairs retokenization drift) or ``"token"`` (token
    ids equal). ``ignore_tools``: when False, timelines whose tool lists differ never merge.
    Raises ValueError for an unknown level and TypeError for a non-bool ``ignore_tools``."""

    compare_level: Literal["text", "token"] = "text"
    ignore_tools: bool = True

    def __post_init__(self) -> None:
        if self.compare_level not in ("text", "token"):
            raise ValueError(f"MergePolicy.compare_level must be 'text' or 'token', got "
                             f"{self.compare_level!r}")
        if not isinstance(self.ignore_tools, bool):
            raise TypeError(f"MergePolicy.ignore_tools must be a bool, got "
                            f"{self.ignore_tools!r}")


@dataclass(frozen=True)
class MergeOutcome:
    """The full result of merging: ``absorber[i]`` is the index of the surviving timeline
    that absorbed timeline ``i`` (``None`` when ``i`` survives, or was discarded);
    ``survivors`` are survivor indices in recording order; ``merged`` maps a survivor index
    to its merged timeline; ``drifted`` maps a survivor index to the message positions whose
    text matched an absorbed timeline's but whose token ids differed. ``discarded`` are the
    indices of the timelines left out of merging (their calls were discarded), and
    ``discarded_context`` maps a survivor index to the message positions where it holds a
    discarded call's output as context."""

    absorber: list[int | None]
    survivors: list[int]
    merged: dict[int, Timeline]
    drifted: dict[int, list[int]] = field(default_factory=dict)
    discarded: list[int] = field(default_factory=list)
    discarded_context: dict[int, list[int]] = field(default_factory=dict)

    def surviving_timelines(self) -> list[Timeline]:
        """The merged survivors in recording order."""
        return [self.merged[i] for i in self.survivors]


#: The default policy: text-level comparison, tool lists ignored.
DEFAULT_POLICY = MergePolicy()


def _check_inputs(timelines: Sequence[Timeline], policy: MergePolicy) -> list[Timeline]:
    if not isinstance(policy, MergePolicy):
        raise TypeError(f"policy must be a MergePolicy, got {type(policy).__name__}")
    if isinstance(timelines, (str, bytes)) or not isinstance(timelines, Sequence):
        raise TypeError(f"timelines must be a sequence of Timeline, got "
                        f"{type(timelines).__name__}")
    out = list(timelines)
    for i, t in enumerate(out):
        if not isinstance(t, Timeline):
            raise TypeError(f"timelines[{i}] must be a Timeline, got {type(t).__name__}")
    return out


def prefix_ids(timeline: Timeline, policy: MergePolicy, *, interner: PrefixInterner,
               keys: dict[int, tuple[Message, Hashable]] | None = None) -> list[int]:
    """Interned ids of ``timeline``'s prefixes under ``policy``: element ``k`` identifies the
    agent (and, with ``ignore_tools=False``, the tool list) plus the first ``k`` messages, so
    two timelines' first ``k`` messages are equal exactly when their ``k``-th ids are.
    ``keys`` (optional) remembers each message object's key across calls under the same
    compare level: timelines of one episode share their history's message objects."""
    root: tuple[str, ...] = (timeline.agent,)
    if not policy.ignore_tools:
        root = (timeline.agent, tools_key(timeline.tools))
    ids = [interner.root(root)]
    level = policy.compare_level
    for m in timeline.messages:
        if keys is None:
            key = message_key(m, level)
        else:
            found = keys.get(id(m))
            if found is None:
                # The message is kept beside its key so that its id is not reused.
                found = keys[id(m)] = (m, message_key(m, level))
            key = found[1]
        ids.append(interner.child(ids[-1], key))
    return ids


def _absorb(survivor: Timeline, absorbed: list[Timeline], *, track_drift: bool
            ) -> tuple[Timeline, list[int]]:
    """Copy the model's messages of ``absorbed`` (later ones first) into ``survivor``; with
    ``track_drift``, also list the positions whose token ids differ from an absorbed one."""
    original = survivor.messages
    merged = list(original)
    drifted: set[int] = set()
    for other in reversed(absorbed):
        for k, m in enumerate(other.messages):
            # Token keys are the id lists as tuples: comparing the lists is the same test,
            # and a message both timelines share (one object) cannot differ from itself.
            if (track_drift and k not in drifted and m is not original[k]
                    and m.token_ids != original[k].token_ids):
                drifted.add(k)
            if m.is_llm and not merged[k].is_llm:
                kept = merged[k]
                merged[k] = Message._built(
                    kept.role, m.author, kept.text, list(m.token_ids),
                    None if m.logprobs is None else list(m.logprobs),
                    tool_calls=kept.tool_calls, truncated=m.truncated,
                    sampled=None if m.sampled is None else list(m.sampled))
    # The survivor's fields, checked when it was built; its tools as a copy of their own.
    return (Timeline._built(survivor.agent, merged, _tool_list(survivor.tools, "tools")),
            sorted(drifted))


def plan_merge(timelines: Sequence[Timeline], policy: MergePolicy = DEFAULT_POLICY, *,
               discarded: Collection[int] = ()) -> MergeOutcome:
    """Merge ``timelines`` (in recording order) under ``policy`` and return every detail:
    who absorbed whom, the merged survivors and their drifted positions. The timelines whose
    indices are in ``discarded`` (their calls were rolled back or abandoned) take no part:
    none absorbs another or is absorbed, none survives, so their generated tokens are never
    trained in a merged timeline; where a survivor holds one's output in its context, that
    position is listed in ``discarded_context``. The inputs are not modified. Raises
    TypeError when ``timelines`` is not a sequence of ``Timeline`` or ``policy`` is not a
    ``MergePolicy``, and IndexError for a ``discarded`` index out of range."""
    items = _check_inputs(timelines, policy)
    interner = PrefixInterner()
    keys: dict[int, tuple[Message, Hashable]] = {}
    return _plan(items, policy, [prefix_ids(t, policy, interner=interner, keys=keys)
                                 for t in items], discarded=discarded)


def _plan(items: list[Timeline], policy: MergePolicy, paths: list[list[int]], *,
          discarded: Collection[int] = ()) -> MergeOutcome:
    """``plan_merge`` given each timeline's ``prefix_ids`` (one interner for all)."""
    left_out = set(discarded)
    for i in left_out:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(items):
            raise IndexError(f"discarded timeline index {i!r} is not one of the "
                             f"{len(items)} timelines")
    best: dict[int, tuple[int, int]] = {}
    for i, t in enumerate(items):
        if i in left_out:
            continue
        rank = (len(t), i)
        for pid in paths[i][1:]:
            current = best.get(pid)
            if current is None or rank > current:
                best[pid] = rank
    absorber: list[int | None] = []
    for i in range(len(items)):
        j = i if i in left_out else best[paths[i][-1]][1]
        absorber.append(None if j == i else j)
    survivors = [i for i, a in enumerate(absorber) if a is None and i not in left_out]
    groups: dict[int, list[Timeline]] = {i: [] for i in survivors}
    for i, a in enumerate(absorber):
        if a is not None:
            groups[a].append(items[i])
    merged: dict[int, Timeline] = {}
    drifted: dict[int, list[int]] = {}
    for i in survivors:
        if groups[i]:
            merged[i], drifted[i] = _absorb(items[i], groups[i],
                                            track_drift=policy.compare_level == "text")
        else:
            merged[i], drifted[i] = items[i], []
    return MergeOutcome(absorber=absorber, survivors=survivors, merged=merged, drifted=drifted,
                        discarded=sorted(left_out),
                        discarded_context=_discarded_context(left_out, survivors, merged,
                                                             paths))


def _discarded_context(left_out: set[int], survivors: list[int], merged: dict[int, Timeline],
                       paths: list[list[int]]) -> dict[int, list[int]]:
    """Survivor index -> the positions of its context messages that are a discarded
    timeline's generated message: the survivor holds that timeline's messages as its own
    first messages (the same prefix id), and the message there is not the model's own in
    the survivor (a kept call's identical output would be)."""
    out: dict[int, set[int]] = {}
    for d in left_out:
        depth = len(paths[d]) - 1  # the discarded timeline's number of messages
        for s in survivors:
            path = paths[s]
            if len(path) > depth and path[depth] == paths[d][-1] \
                    and not merged[s].messages[depth - 1].is_llm:
                out.setdefault(s, set()).add(depth - 1)
    return {s: sorted(positions) for s, positions in sorted(out.items())}


def merge_timelines(timelines: Sequence[Timeline], policy: MergePolicy = DEFAULT_POLICY
                    ) -> list[Timeline]:
    """The surviving timelines, merged, in recording order (see the module docstring for
    the rules). Raises TypeError when ``timelines`` is not a sequence of ``Timeline`` or
    ``policy`` is not a ``MergePolicy``."""
    return plan_merge(timelines, policy).surviving_timelines()
