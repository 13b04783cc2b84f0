"""A plain pairwise reference for timeline merging, written from the rules alone: for every
timeline, look at every other timeline, compare message by message, take the greatest one it
merges into. Quadratic on purpose; the tests check ``merge_timelines`` against it."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from workers.replay.timeline import MergePolicy, Message, Timeline

__all__ = ["reference_merge"]


def _calls(message: Message) -> list[tuple[str, Any]]:
    out = []
    for call in message.tool_calls or []:
        fn = call.get("function", call)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                args = ("unparsed", args)
        out.append((fn.get("name", ""), args))
    return out


def _same(a: Message, b: Message, level: str) -> bool:
    if level == "token":
        return list(a.token_ids) == list(b.token_ids)
    return a.role == b.role and a.text == b.text and _calls(a) == _calls(b)


def _merges_into(a: Timeline, b: Timeline, policy: MergePolicy) -> bool:
    if a.agent != b.agent or len(a.messages) > len(b.messages):
        return False
    if not policy.ignore_tools and (a.tools or []) != (b.tools or []):
        return False
    return all(_same(a.messages[k], b.messages[k], policy.compare_level)
               for k in range(len(a.messages)))


def reference_merge(timelines: list[Timeline], policy: MergePolicy) -> list[Timeline]:
    absorber: list[int | None] = []
    for i, a in enumerate(timelines):
        best = None
        for j, b in enumerate(timelines):
            if j == i or (len(b.messages), j) <= (len(a.messages), i):
                continue
            if _merges_into(a, b, policy):
                if best is None or (len(b.messages), j) > (len(timelines[best].messages), best):
                    best = j
        absorber.append(best)
    out = []
    for s, survivor in enumerate(timelines):
        if absorber[s] is not None:
            continue
        messages = list(survivor.messages)
        # Later absorbed timelines first, so the later of two copies wins.
        for i in range(len(timelines) - 1, -1, -1):
            if absorber[i] != s:
                continue
            for k, m in enumerate(timelines[i].messages):
                if m.author == "llm" and messages[k].author != "llm":
                    messages[k] = dataclasses.replace(
                        messages[k], author=m.author, token_ids=m.token_ids,
                        logprobs=m.logprobs, sampled=m.sampled, truncated=m.truncated)
        out.append(dataclasses.replace(survivor, messages=messages))
    return out
