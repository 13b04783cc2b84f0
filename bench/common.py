"""Helpers shared by the benchmarks: a throwaway database and realistic trajectories."""

from __future__ import annotations

import contextlib
import urllib.parse
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import psycopg

from store import embedded, migrate
from store.events import LLMCalled
from store.settings import Settings

__all__ = ["scratch_database", "realistic_trajectory", "words"]


@contextlib.contextmanager
def scratch_database(settings: Settings | None = None) -> Iterator[str]:
    """A new migrated database on the configured server (or the embedded one), dropped
    afterwards."""
    settings = settings or Settings()
    admin = settings.test_database_url or embedded.owner_database_url(settings)
    name = f"trajstore_bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = urllib.parse.urlunsplit(urllib.parse.urlsplit(admin)._replace(path="/" + name))
    try:
        migrate.upgrade(url)
        yield url
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


_VOCAB = [
    "the", "of", "result", "tool", "call", "value", "error", "function", "return", "file",
    "line", "print", "import", "def", "x", "y", "answer", "compute", "list", "for", "in",
    "is", "a", "to", "and", "we", "need", "check", "number", "output", "step", "then",
]


def words(rng: np.random.Generator, tokens: int) -> str:
    """About ``tokens`` tokens of English-like text (Zipf-distributed words)."""
    idx = np.minimum(rng.zipf(1.3, tokens) - 1, len(_VOCAB) - 1)
    return " ".join(_VOCAB[i] for i in idx)


def realistic_trajectory(
    turns: int, *, new_prompt: int, generated: int, seed: int, vocab: int = 151_936
) -> list[LLMCalled]:
    """``turns`` LLM calls: the first prompt has ``new_prompt`` tokens; every later prompt is
    the previous prompt + its generation + ``new_prompt`` new tokens (tool output and
    template). Messages carry text of matching length, as a real agent's would."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab, new_prompt)
    messages: list[dict[str, Any]] = [{"role": "user", "content": words(rng, new_prompt)}]
    calls = []
    for t in range(turns):
        out = rng.integers(0, vocab, generated)
        reply = {"role": "assistant", "content": words(rng, generated)}
        calls.append(
            LLMCalled(
                event_id=uuid.uuid4(),
                call_id=f"call-{t}",
                messages=list(messages),
                prompt_ids=prompt,
                response_ids=out,
                logprobs=-rng.exponential(0.5, generated),
                response=reply,
                finish_reason="stop",
                policy_version=0,
                latency_ms=float(rng.integers(50, 500)),
                usage={"prompt_tokens": len(prompt), "completion_tokens": generated},
            )
        )
        messages = messages + [reply, {"role": "tool", "content": words(rng, new_prompt)}]
        prompt = np.concatenate([prompt, out, rng.integers(0, vocab, new_prompt)])
    return calls
