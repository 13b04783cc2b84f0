"""Fork detection: where an agent's timelines stop sharing history, and why.

A timeline forks from an earlier one of the same agent when both hold the same first ``k``
messages (and, with ``ignore_tools=False``, the same tools) and then differ at message ``k``
while both go on. Each timeline is reported at most once, against the earlier timeline that
shares its longest history and then differs (the latest such on ties). Extending an earlier
timeline, or being a prefix of one, is not a fork. Reasons, first match wins: ``tools`` (the
tool lists differ; ``message_index`` is then 0), ``content`` (role or content differ),
``tool_calls`` (the calls differ), ``token_drift`` (same text, different token ids; only a
divergence at ``token`` level).

The walk is linear in the number of messages: message prefixes are interned to integers and
earlier timelines are kept as a trie of those ids.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

from workers.replay.equality import PrefixInterner, tool_calls_key, tools_key
from workers.replay.timeline import (
    DEFAULT_POLICY,
    MergeOutcome,
    MergePolicy,
    Message,
    Timeline,
    _check_inputs,
    _plan,
    prefix_ids,
)

__all__ = ["ForkPoint", "ForkReason", "detect_forks", "fork_reason", "merge_and_detect_forks"]

ForkReason = Literal["content", "tool_calls", "tools", "token_drift"]


@dataclass(frozen=True)
class ForkPoint:
    """Timeline ``timeline_index`` diverges from the earlier ``parent_index`` (both indices
    in recording order) at message ``message_index`` for ``reason``."""

    agent: str
    timeline_index: int
    parent_index: int
    message_index: int
    reason: ForkReason


def fork_reason(a: Timeline, b: Timeline, *, index: int) -> ForkReason:
    """Why message ``index`` of ``a`` and ``b`` differ: ``content`` (role or text),
    ``tool_calls`` or ``token_drift`` (same text, different tokens). Raises IndexError when
    either timeline is shorter than ``index + 1`` and ValueError when the two messages are
    identical in text and tokens."""
    if index < 0 or index >= len(a) or index >= len(b):
        raise IndexError(f"message index {index} is outside timelines of lengths "
                         f"{len(a)} and {len(b)}")
    ma, mb = a.messages[index], b.messages[index]
    if (ma.role, ma.text) != (mb.role, mb.text):
        return "content"
    if tool_calls_key(ma.tool_calls) != tool_calls_key(mb.tool_calls):
        return "tool_calls"
    if ma.token_ids != mb.token_ids:
        return "token_drift"
    raise ValueError(f"messages at index {index} are identical; there is no fork there")


def detect_forks(timelines: Sequence[Timeline], policy: MergePolicy = DEFAULT_POLICY
                 ) -> list[ForkPoint]:
    """Fork points of ``timelines`` (in recording order) under ``policy``, one at most per
    timeline, in recording order. Raises TypeError for inputs that are not a sequence of
    ``Timeline`` or a ``MergePolicy``."""
    items = _check_inputs(timelines, policy)
    interner = PrefixInterner()
    keys: dict[int, tuple[Message, Hashable]] = {}
    return _forks(items, policy, [_path(t, policy, interner, keys) for t in items])


def merge_and_detect_forks(timelines: Sequence[Timeline], policy: MergePolicy = DEFAULT_POLICY,
                           *, discarded: Collection[int] = ()
                           ) -> tuple[MergeOutcome, list[ForkPoint]]:
    """``plan_merge`` (leaving ``discarded`` out of merging) and ``detect_forks`` (over every
    timeline: a rollback is where history forked) of the same timelines, keying every
    message and prefix once for both (with ``ignore_tools`` their paths are the same prefix
    ids). Raises as they do."""
    items = _check_inputs(timelines, policy)
    interner = PrefixInterner()
    keys: dict[int, tuple[Message, Hashable]] = {}
    paths = [prefix_ids(t, policy, interner=interner, keys=keys) for t in items]
    fork_paths = (paths if policy.ignore_tools
                  else [_path(t, policy, interner, keys) for t in items])
    return (_plan(items, policy, paths, discarded=discarded),
            _forks(items, policy, fork_paths))


def _forks(items: list[Timeline], policy: MergePolicy, paths: list[list[int]]
           ) -> list[ForkPoint]:
    """``detect_forks`` given each timeline's path (``_path``, one interner for all)."""
    # children[node] maps each next prefix id seen after ``node`` to the latest timeline
    # that went that way. With ignore_tools=False the first step of a path is the tool list.
    children: dict[int, dict[int, int]] = {}
    forks: list[ForkPoint] = []
    for i, t in enumerate(items):
        path = paths[i]
        found: tuple[int, int] | None = None
        for depth in range(len(path) - 1):
            branches = children.get(path[depth])
            if branches is None:
                break
            others = [j for nxt, j in branches.items() if nxt != path[depth + 1]]
            if others:
                found = (depth, max(others))
        if found is not None:
            depth, parent = found
            forks.append(_fork_point(t, items[parent], i, parent, depth, policy))
        for depth in range(len(path) - 1):
            children.setdefault(path[depth], {})[path[depth + 1]] = i
    return forks


def _path(t: Timeline, policy: MergePolicy, interner: PrefixInterner,
          keys: dict[int, tuple[Message, Hashable]]) -> list[int]:
    ids = prefix_ids(t, MergePolicy(compare_level=policy.compare_level, ignore_tools=True),
                     interner=interner, keys=keys)
    if policy.ignore_tools:
        return ids
    # Insert the tool list as its own step so that a tools difference is a fork at the root.
    tools_node = interner.child(ids[0], ("tools", tools_key(t.tools)))
    path = [ids[0], tools_node]
    for m_id in ids[1:]:
        path.append(interner.child(path[-1], ("after", m_id)))
    return path


def _fork_point(t: Timeline, parent: Timeline, index: int, parent_index: int, depth: int,
                policy: MergePolicy) -> ForkPoint:
    if not policy.ignore_tools:
        if depth == 0:
            return ForkPoint(t.agent, index, parent_index, 0, "tools")
        depth -= 1
    reason = fork_reason(t, parent, index=depth)
    if policy.compare_level == "text" and reason == "token_drift":  # pragma: no cover
        raise AssertionError("text-equal messages cannot fork at text level")
    return ForkPoint(t.agent, index, parent_index, depth, reason)

