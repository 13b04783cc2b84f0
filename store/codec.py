"""Binary token payloads and prompt delta encoding.

Token ids are packed little-endian int32 and logprobs little-endian float32, whatever the
host's byte order, so that any reader (numpy, another language, a binary COPY) decodes them
the same way.

An LLM call's prompt nearly always extends an earlier call of the same stream: the earlier
prompt, its generation, then a tool result and the template's glue. Storing every prompt in
full makes an N-turn trajectory cost O(N²) tokens; storing ``(base call, shared prefix length,
new suffix)`` keeps it O(unique tokens). ``choose_delta`` picks the base with the longest
shared prefix among a few recent candidates; ``expand_prompt`` undoes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "ID_DTYPE",
    "LOGPROB_DTYPE",
    "pack_ids",
    "pack_logprobs",
    "pack_mask",
    "unpack_ids",
    "unpack_logprobs",
    "unpack_mask",
    "common_prefix_len",
    "Delta",
    "choose_delta",
    "expand_prompt",
]

# The byte layout of every token payload, in the store and on the wire (base64 in JSON).
ID_DTYPE = "<i4"
LOGPROB_DTYPE = "<f4"
_I32 = np.dtype(ID_DTYPE)
_F32 = np.dtype(LOGPROB_DTYPE)


def pack_ids(ids: np.ndarray) -> bytes:
    """int32 little-endian bytes of ``ids``."""
    return np.ascontiguousarray(ids, dtype=_I32).tobytes()


def pack_logprobs(values: np.ndarray) -> bytes:
    """float32 little-endian bytes of ``values``."""
    return np.ascontiguousarray(values, dtype=_F32).tobytes()


def pack_mask(mask: np.ndarray) -> bytes:
    """One byte per token: 1 where the token is trained, 0 where it is not."""
    return np.ascontiguousarray(mask, dtype=np.uint8).tobytes()


def unpack_mask(buf: bytes | memoryview | None) -> np.ndarray:
    """The loss mask packed by ``pack_mask`` (a writable copy)."""
    if buf is None:
        return np.zeros(0, dtype=np.uint8)
    return np.frombuffer(buf, dtype=np.uint8).copy()


def unpack_ids(buf: bytes | memoryview | None) -> np.ndarray:
    """The int32 array packed in ``buf``; raises ``ValueError`` when its length is not a
    multiple of 4 (a truncated or foreign payload)."""
    if buf is None:
        return np.zeros(0, dtype=np.int32)
    if len(buf) % 4:
        raise ValueError(f"token payload of {len(buf)} bytes is not a whole number of int32")
    return np.frombuffer(buf, dtype=_I32).astype(np.int32, copy=False)


def unpack_logprobs(buf: bytes | memoryview | None) -> np.ndarray:
    """The float32 array packed in ``buf``; same checks as ``unpack_ids``."""
    if buf is None:
        return np.zeros(0, dtype=np.float32)
    if len(buf) % 4:
        raise ValueError(f"logprob payload of {len(buf)} bytes is not a whole number of float32")
    return np.frombuffer(buf, dtype=_F32).astype(np.float32, copy=False)


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D arrays (vectorised)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


@dataclass(frozen=True, slots=True)
class Delta:
    """A prompt stored as ``base_sequence[:prefix_len] + suffix``.

    ``base_version`` is the stream version of the earlier ``llm_called`` event whose prompt
    followed by its generated ids is ``base_sequence``.
    """

    base_version: int
    prefix_len: int
    suffix: np.ndarray


def choose_delta(
    prompt: np.ndarray,
    candidates: Sequence[tuple[int, np.ndarray]],
    *,
    min_prefix: int,
) -> Delta | None:
    """The best delta of ``prompt`` against ``candidates`` (``(version, prompt+response)``),
    or None when no candidate shares at least ``min_prefix`` tokens. Ties keep the latest
    candidate, whose chain is the shortest to decode."""
    best: Delta | None = None
    ordered = list(reversed(candidates))  # newest first: ties keep the newest
    # longest[i]: the longest sequence among ordered[i:]; no candidate there can share more.
    longest = [0] * (len(ordered) + 1)
    for i in range(len(ordered) - 1, -1, -1):
        longest[i] = max(longest[i + 1], len(ordered[i][1]))
    for i, (version, sequence) in enumerate(ordered):
        if best is not None and longest[i] <= best.prefix_len:
            break
        shared = common_prefix_len(prompt, sequence)
        if shared >= min_prefix and (best is None or shared > best.prefix_len):
            best = Delta(version, shared, prompt[shared:])
    return best


def expand_prompt(base_sequence: np.ndarray, prefix_len: int, suffix: np.ndarray) -> np.ndarray:
    """The full prompt of a delta; raises ``ValueError`` when the base is shorter than the
    prefix it should supply (a corrupt or mismatched base)."""
    if prefix_len > len(base_sequence):
        raise ValueError(
            f"delta needs {prefix_len} prefix tokens but its base has only {len(base_sequence)}"
        )
    out = np.concatenate([base_sequence[:prefix_len], suffix]).astype(np.int32, copy=False)
    out.flags.writeable = False
    return out
