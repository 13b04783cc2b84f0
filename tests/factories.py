"""Builders of realistic events for the tests (real token arrays, real shapes)."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import numpy as np

from store.events import EpisodeFinished, EpisodeStarted, LLMCalled, RewardAssigned, ToolReturned


def episode_started(run_id: str = "run-a", group_id: str = "g0", **kw: Any) -> EpisodeStarted:
    return EpisodeStarted(
        run_id=run_id,
        group_id=group_id,
        task_id="t0",
        messages=[{"role": "user", "content": "What is 2+3?"}],
        **kw,
    )


def trajectory(
    turns: int,
    *,
    seed: int = 0,
    first_prompt: int = 200,
    response: int = 50,
    tool_output: int = 20,
    agent: str = "main",
) -> list[LLMCalled]:
    """``turns`` LLM calls where each prompt extends the previous prompt + generation + a tool
    output, as a multi-turn agent's prompts do."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 150_000, first_prompt)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "solve it"}]
    calls = []
    for t in range(turns):
        out = rng.integers(0, 150_000, response)
        reply = {"role": "assistant", "content": f"turn {t} answer {int(out[0])}"}
        calls.append(
            LLMCalled(
                event_id=uuid.uuid4(),
                agent=agent,
                call_id=f"{agent}-{t}",
                messages=list(messages),
                prompt_ids=prompt,
                response_ids=out,
                logprobs=-rng.random(response).astype(np.float32),
                response=reply,
                finish_reason="stop",
            )
        )
        messages = messages + [reply, {"role": "tool", "content": f"result {t}"}]
        prompt = np.concatenate([prompt, out, rng.integers(0, 150_000, tool_output)])
    return calls


def closing(value: float = 1.0) -> list[Any]:
    return [
        ToolReturned(name="calculator", arguments={"expr": "2+3"}, output="5"),
        RewardAssigned(value=value, components={"correct": value}),
        EpisodeFinished(status="completed"),
    ]


def database_now(store: Any) -> dt.datetime:
    """The database's clock (what leases and the sweep measure time by). Tests pass a time
    ahead of it to ``Leasing.expire(now=...)`` or ``abort_stale_episodes(now=...)`` instead
    of sleeping until a lease or an episode times out."""
    with store.db.connection() as conn:
        return conn.execute("SELECT now()").fetchone()[0]
