"""Token payloads over HTTP: JSON lists, or base64 of little-endian int32 / float32.

Token ids (``prompt_ids``, ``response_ids``, ``token_ids``, ``prompt_token_ids``) are int32;
log-probabilities (``logprobs``, ``rollout_log_probs``) float32; loss masks uint8. On input
either form is accepted per field: a JSON array, or a string holding the base64 (standard
alphabet, with padding) of the little-endian bytes. On output the caller picks one form for
the whole response with ``encoding=json`` (default) or ``encoding=base64``.

A thousand-token prompt is about 5 KB as a JSON list and 5.3 KB as base64, but base64 skips
parsing a thousand numbers on both sides: use it for bulk ingest.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

from store.codec import ID_DTYPE, LOGPROB_DTYPE
from store.errors import ValidationError
from store.events import TOKEN_FIELDS

__all__ = [
    "Encoding",
    "TOKEN_DTYPES",
    "decode_array",
    "decode_event_tokens",
    "encode_array",
]

Encoding = Literal["json", "base64"]

#: The little-endian dtype of each token field.
TOKEN_DTYPES: dict[str, str] = {
    "prompt_ids": ID_DTYPE,
    "response_ids": ID_DTYPE,
    "token_ids": ID_DTYPE,
    "prompt_token_ids": ID_DTYPE,
    "logprobs": LOGPROB_DTYPE,
    "rollout_log_probs": LOGPROB_DTYPE,
    "loss_mask": "u1",
    "response_mask": "u1",
}


def decode_array(value: Any, *, dtype: str, field: str) -> Any:
    """``value`` as given when it is a list; decoded to a numpy array of ``dtype`` when it
    is a base64 string. Raises ValueError naming ``field`` for a string that is not base64
    or whose byte length is not a multiple of the item size, TypeError for anything else."""
    if isinstance(value, list | np.ndarray):
        return value
    if not isinstance(value, str):
        raise TypeError(f"{field} must be a JSON array or a base64 string, got "
                        f"{type(value).__name__}")
    try:
        raw = binascii.a2b_base64(value, strict_mode=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{field} is a string but not valid base64") from None
    size = np.dtype(dtype).itemsize
    if len(raw) % size:
        raise ValueError(f"{field} holds {len(raw)} bytes, not a multiple of {size} "
                         f"({np.dtype(dtype).name} little-endian)")
    return np.frombuffer(raw, dtype=dtype)


def decode_event_tokens(event: Mapping[str, Any], index: int) -> Mapping[str, Any]:
    """The event with its base64 token fields decoded (the same mapping when it has none).
    Raises ``store.errors.ValidationError`` naming the event ``index`` and the field."""
    if not isinstance(event, Mapping):
        return event
    changed: dict[str, Any] | None = None
    for name in TOKEN_FIELDS:
        value = event.get(name)
        if isinstance(value, str):
            try:
                decoded = decode_array(value, dtype=TOKEN_DTYPES[name], field=name)
            except (TypeError, ValueError) as exc:
                raise ValidationError(str(exc), event_index=index, field=name) from None
            if changed is None:
                changed = dict(event)
            changed[name] = decoded
    return event if changed is None else changed


def encode_array(values: Any, *, dtype: str, encoding: Encoding) -> list[Any] | str:
    """``values`` (a sequence or array) as a JSON list, or as base64 of its little-endian
    ``dtype`` bytes. Raises ValueError for an unknown ``encoding``."""
    arr = np.ascontiguousarray(values, dtype=dtype)
    if encoding == "json":
        return arr.tolist()
    if encoding == "base64":
        return base64.b64encode(arr.tobytes()).decode("ascii")
    raise ValueError(f"encoding must be 'json' or 'base64', got {encoding!r}")
