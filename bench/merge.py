"""Benchmark: timeline merging against a straightforward pairwise implementation.

An agent episode of N turns gives one timeline per LLM call, each extending the previous one
by a tool result and a new generation; every tenth turn also has a failed call and a retry
with error feedback (a fork that survives), and every seventh generation drifted (same text,
other ids). ``merge_timelines`` interns message prefixes (linear time); the baseline compares
every pair of timelines message by message, as the rules read. Both run in this process on
the same timelines; their outputs must be identical.

    python bench/merge.py                 # 250 turns, text and token level
    python bench/merge.py --turns 100 --tokens 32
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.replay.timeline import (  # noqa: E402
    MergePolicy,
    Message,
    Timeline,
    merge_timelines,
)

__all__ = ["build_episode", "main", "pairwise_merge"]


def _ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + k * 104729) % 150000 for k in range(n)]


def _call(turn: int, query: str) -> list[dict[str, Any]]:
    return [{"id": f"c{turn}", "type": "function",
             "function": {"name": "run", "arguments": json.dumps({"code": query, "turn": turn})}}]


def _fresh(messages: list[Message]) -> list[Message]:
    """Copies with their own token lists, as replay builds every timeline from its own prompt."""
    return [dataclasses.replace(m, token_ids=list(m.token_ids)) for m in messages]


def build_episode(turns: int, tokens: int) -> list[Timeline]:
    """The timelines of one episode, in recording order (see the module docstring)."""
    system = Message("system", "env", "You are an agent.", _ids(1, tokens), None)
    user = Message("user", "user", "Solve the task.", _ids(2, tokens), None)
    context: list[Message] = [system, user]
    out: list[Timeline] = []
    for t in range(turns):
        text, calls = f"step {t}", _call(t, f"print({t})")
        gen_ids = _ids(1000 + t, tokens)
        if t % 10 == 5:
            bad = Message("assistant", "llm", text, _ids(5000 + t, tokens), [-0.5] * tokens,
                          _call(t, "prnt("))
            out.append(Timeline("main", [*_fresh(context), bad]))
            error = Message("tool", "tool", "NameError: prnt", _ids(6000 + t, tokens), None)
            feedback = Message("user", "user", "Fix the call.", _ids(7000 + t, tokens), None)
            fixed = Message("assistant", "llm", text, gen_ids, [-0.25] * tokens, calls)
            out.append(Timeline("main", [*_fresh(context), dataclasses.replace(bad, author="env"),
                                         error, feedback, fixed]))
        generated = Message("assistant", "llm", text, gen_ids, [-0.5] * tokens, calls)
        out.append(Timeline("main", [*_fresh(context), generated]))
        later_ids = list(reversed(gen_ids)) if t % 7 == 3 else gen_ids  # drift
        context = [*context,
                   Message("assistant", "env", text, later_ids, None, calls),
                   Message("tool", "tool", f"output {t}", _ids(3000 + t, tokens), None)]
    return out


def _same(a: Message, b: Message, level: str) -> bool:
    if level == "token":
        return a.token_ids == b.token_ids
    if a.role != b.role or a.text != b.text:
        return False
    calls_a = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
               for c in a.tool_calls or []]
    calls_b = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
               for c in b.tool_calls or []]
    return calls_a == calls_b


def pairwise_merge(timelines: list[Timeline], policy: MergePolicy) -> list[Timeline]:
    """The baseline: for every timeline, every other timeline, message by message."""
    absorber: list[int | None] = []
    for i, a in enumerate(timelines):
        best: int | None = None
        for j, b in enumerate(timelines):
            if j == i or a.agent != b.agent or (len(b), j) <= (len(a), i):
                continue
            if not policy.ignore_tools and (a.tools or []) != (b.tools or []):
                continue
            if all(_same(a.messages[k], b.messages[k], policy.compare_level)
                   for k in range(len(a))):
                if best is None or (len(b), j) > (len(timelines[best]), best):
                    best = j
        absorber.append(best)
    out = []
    for s, survivor in enumerate(timelines):
        if absorber[s] is not None:
            continue
        merged = list(survivor.messages)
        for i in range(len(timelines) - 1, -1, -1):
            if absorber[i] == s:
                for k, m in enumerate(timelines[i].messages):
                    if m.author == "llm" and merged[k].author != "llm":
                        merged[k] = dataclasses.replace(
                            merged[k], author=m.author, token_ids=m.token_ids,
                            logprobs=m.logprobs, sampled=m.sampled, truncated=m.truncated)
        out.append(dataclasses.replace(survivor, messages=merged))
    return out


def _timed(fn: Any, *args: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - start, result


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the benchmark; returns the speed ratio per compare level."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=250)
    parser.add_argument("--tokens", type=int, default=64, help="tokens per message")
    args = parser.parse_args(argv)
    timelines = build_episode(args.turns, args.tokens)
    messages = sum(len(t) for t in timelines)
    print(f"episode: {args.turns} turns, {len(timelines)} timelines, {messages} messages, "
          f"{messages * args.tokens} tokens")
    ratios = {}
    for level in ("text", "token"):
        policy = MergePolicy(compare_level=level)
        fast_s, fast = _timed(merge_timelines, timelines, policy)
        slow_s, slow = _timed(pairwise_merge, timelines, policy)
        assert fast == slow, f"outputs differ at {level} level"
        ratios[level] = slow_s / fast_s
        print(f"{level:>5}: merge_timelines {fast_s * 1e3:9.1f} ms   "
              f"pairwise {slow_s * 1e3:9.1f} ms   ratio {ratios[level]:6.1f}x   "
              f"survivors {len(fast)}")
    return ratios


if __name__ == "__main__":
    main()
