"""Hand-made timeline messages and random episodes shared by the merge and fork tests."""

from __future__ import annotations

import random

from workers.replay.timeline import MergePolicy, Message, Timeline

__all__ = ["A1", "A2", "CALL", "T_OUT", "TEXT", "TOKEN", "U", "as_ctx", "ctx", "gen",
           "random_episode", "tl"]

TEXT = MergePolicy()
TOKEN = MergePolicy(compare_level="token")


def ctx(role: str, text: str, ids: list[int], tool_calls: list[dict] | None = None) -> Message:
    return Message(role=role, author="env" if role != "tool" else "tool", text=text,
                   token_ids=ids, logprobs=None, tool_calls=tool_calls)


def gen(text: str, ids: list[int], *, prompt: int = 0, lp: float = -0.5,
        tool_calls: list[dict] | None = None, truncated: bool = False) -> Message:
    """A generated message: ``prompt`` generation-prompt ids 90.. then ``ids`` (sampled)."""
    head = list(range(90, 90 + prompt))
    return Message(role="assistant", author="llm", text=text, token_ids=head + ids,
                   logprobs=[0.0] * prompt + [lp] * len(ids), tool_calls=tool_calls,
                   truncated=truncated, sampled=[0] * prompt + [1] * len(ids))


def as_ctx(m: Message) -> Message:
    """The same message as it appears in a later request."""
    return ctx(m.role, m.text, m.token_ids, m.tool_calls)


def tl(*messages: Message, agent: str = "main", tools: list[dict] | None = None) -> Timeline:
    return Timeline(agent=agent, messages=list(messages), tools=tools)


CALL = {"id": "c1", "type": "function", "function": {"name": "search",
                                                      "arguments": '{"query": "x"}'}}
U = ctx("user", "question", [1, 2, 3])
A1 = gen("first", [10, 11], tool_calls=[CALL])
T_OUT = ctx("tool", "result", [20, 21])
A2 = gen("second", [12, 13])


_TEXTS = ["a", "b", "c"]
_TOOLS = [None, [{"type": "function", "function": {"name": "x"}}]]


def random_episode(rng: random.Random, n: int) -> list[Timeline]:
    """Timelines that share history the way an agent's calls do: prefixes of a few random
    conversations, the last message generated, some with drifted or duplicated tokens."""
    bases = []
    for _ in range(rng.randint(1, 3)):
        conv = []
        for _ in range(rng.randint(1, 6)):
            role = rng.choice(["user", "assistant", "tool"])
            text = rng.choice(_TEXTS)
            ids = [ord(text), rng.choice([1, 1, 1, 2])]  # same text, sometimes other ids
            calls = [{"function": {"name": "f", "arguments": rng.choice(['{"a":1}', "{}"])}}] \
                if role == "assistant" and rng.random() < 0.3 else None
            conv.append(ctx(role, text, ids, calls))
        bases.append((rng.choice(["a", "b"]), rng.choice(_TOOLS), conv))
    out = []
    for _ in range(n):
        agent, tools, conv = rng.choice(bases)
        k = rng.randint(1, len(conv))
        last = conv[k - 1]
        generated = Message(role="assistant", author="llm", text=last.text,
                            token_ids=[ord(last.text), rng.choice([1, 2])],
                            logprobs=[-rng.random(), -rng.random()],
                            tool_calls=last.tool_calls if last.role == "assistant" else None,
                            truncated=rng.random() < 0.2)
        messages = [*conv[:k - 1], generated]
        if rng.random() < 0.2:
            tools = rng.choice(_TOOLS)
        out.append(Timeline(agent=agent, messages=messages, tools=tools))
    return out
