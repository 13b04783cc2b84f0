"""The remote-rollout token buffer and the response-mask check (TrainGate protocol).

A RolloutServer sends the full conversation on every call and a ``response_mask``: null on
the first call, then one 0 for each token added since the previous generation (tool
outputs and template tokens). The store does not trust the mask: it keeps, per rollout and
agent, an append-only buffer of what the engine saw and produced (the previous call's prompt
ids followed by its generated ids), renders the new prompt itself, and checks

- that the new prompt extends the buffer token for token (a shorter or different prefix
  means the RolloutServer truncated or summarised context, a template stripped earlier
  reasoning, or the two sides tokenize differently);
- that the mask has exactly ``len(prompt) - len(buffer)`` entries, all 0;
- that a first call carries no mask, and a later one does.

A request without a ``response_mask`` key at all comes from a protocol revision that has no
mask (the asynchronous one's chat completions): its prefix is checked, its mask is not, and
``mask_missing`` is not reported. An explicit ``"response_mask": null`` after the first call
is ``mask_missing``.

The outcome is recorded on the call's ``llm_called`` event (``response.mask_check``); the
loss mask of training samples always comes from replay, which marks exactly the tokens the
engine sampled. The buffer itself is a fold over the episode's events (the agent's last
``llm_called``), cached per process and checked against the stream version.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from store.eventlog import EventStore
from store.events import LLMCalled

__all__ = ["MaskCheck", "RolloutBuffers", "check_mask", "first_divergence"]


def first_divergence(a: np.ndarray, b: np.ndarray) -> int | None:
    """The first index where int arrays ``a`` and ``b`` differ, ``min(len)`` when one is a
    proper prefix of the other, None when they are equal. Shapes ``(n,)`` and ``(m,)``."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    if diff.size:
        return int(diff[0])
    return None if len(a) == len(b) else n


@dataclass(frozen=True)
class MaskCheck:
    """The outcome of checking one call. ``status``: ``first_call`` (nothing to check),
    ``ok`` or ``mismatch`` (``reasons`` says which checks failed). ``buffer_length``: tokens
    in the buffer before this call; ``new_tokens``: prompt length minus that (negative when
    the prompt is shorter); ``divergence``: first prompt index that differs from the
    buffer."""

    status: Literal["first_call", "ok", "mismatch"]
    reasons: tuple[str, ...] = ()
    buffer_length: int = 0
    prompt_length: int = 0
    new_tokens: int = 0
    mask_length: int | None = None
    divergence: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "reasons": list(self.reasons),
                "buffer_length": self.buffer_length, "prompt_length": self.prompt_length,
                "new_tokens": self.new_tokens, "mask_length": self.mask_length,
                "divergence": self.divergence}


def check_mask(buffer: Sequence[int] | np.ndarray | None, prompt: Sequence[int] | np.ndarray,
               response_mask: Sequence[int] | None, *, mask_sent: bool = True) -> MaskCheck:
    """Check a call's prompt and mask against the buffer (module docstring). ``buffer`` is
    None on the rollout's first call; ``mask_sent`` False: the request had no
    ``response_mask`` key (a revision without masks), so only the prefix is checked. Never
    raises for a mismatch: it reports it. Raises TypeError when ``prompt`` is not a sequence
    of integers."""
    p = np.asarray(prompt, dtype=np.int64)
    if p.ndim != 1:
        raise TypeError(f"prompt must be a 1-d sequence of token ids, got shape {p.shape}")
    mask_length = None if response_mask is None else len(response_mask)
    if buffer is None:
        if response_mask:
            return MaskCheck("mismatch", ("mask_on_first_call",), 0, len(p), len(p),
                             mask_length, None)
        return MaskCheck("first_call", (), 0, len(p), len(p), mask_length, None)
    b = np.asarray(buffer, dtype=np.int64)
    reasons: list[str] = []
    divergence = first_divergence(p[: len(b)], b) if len(p) >= len(b) else \
        first_divergence(p, b)
    if len(p) < len(b):
        reasons.append("prompt_shorter_than_buffer")
    elif divergence is not None:
        reasons.append("prefix_mismatch")
    new = len(p) - len(b)
    if response_mask is None:
        if mask_sent:
            reasons.append("mask_missing")
    else:
        if len(response_mask) != new:
            reasons.append("mask_length")
        if any(v != 0 for v in response_mask):
            reasons.append("mask_marks_generated")
    return MaskCheck("mismatch" if reasons else "ok", tuple(reasons), len(b), len(p), new,
                     mask_length, divergence)


class RolloutBuffers:
    """Per rollout (episode) and agent: the token buffer, read from the store and cached by
    stream version."""

    def __init__(self, store: EventStore, *, capacity: int = 4096) -> None:
        self.store = store
        self.capacity = capacity
        self._cache: OrderedDict[str, tuple[int, dict[str, np.ndarray]]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, episode_id: str, agent: str) -> tuple[int, np.ndarray | None]:
        """``(stream_version, buffer)`` of the agent in the episode; the buffer is None when
        the agent has made no call yet."""
        version = self.store.stream_version(episode_id)
        with self._lock:
            cached = self._cache.get(episode_id)
        if cached is None or cached[0] != version:
            buffers: dict[str, np.ndarray] = {}
            for r in self.store.read_stream(episode_id):
                event = r.event
                if isinstance(event, LLMCalled):
                    buffers[event.agent] = np.concatenate(
                        [event.prompt_ids, event.response_ids]).astype(np.int32)
                version = max(version, r.stream_version)
            cached = (version, buffers)
            self._put(episode_id, cached)
        return cached[0], cached[1].get(agent)

    def remember(self, episode_id: str, agent: str, *, version: int,
                 prompt_ids: Sequence[int], response_ids: Sequence[int]) -> None:
        """After appending a call at ``version``: the agent's buffer is its prompt and
        generation (other agents' buffers stay)."""
        with self._lock:
            cached = self._cache.get(episode_id)
            if cached is None or cached[0] != version - 1:
                # Not the state just before this call: other agents' buffers may be
                # missing; read them from the store next time.
                self._cache.pop(episode_id, None)
                return
        buffers = dict(cached[1])
        buffers[agent] = np.concatenate([np.asarray(prompt_ids, dtype=np.int32),
                                         np.asarray(response_ids, dtype=np.int32)])
        self._put(episode_id, (version, buffers))

    def _put(self, episode_id: str, value: tuple[int, dict[str, np.ndarray]]) -> None:
        with self._lock:
            self._cache[episode_id] = value
            self._cache.move_to_end(episode_id)
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
