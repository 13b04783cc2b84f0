"""Normalising what a caller sends before it is rendered and recorded.

Explicit nulls mean "not given": they are dropped from messages (a null ``content`` becomes
``""``, which every chat template renders as nothing), so that templates never see ``None``.
Unknown message keys are kept as sent. The normalised messages are what the prompt is
rendered from and what the ``llm_called`` event records, so replay renders the same prompt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from api.errors import ApiError
from workers.engines.backend import SamplingParams

__all__ = ["DEFAULT_MAX_TOKENS", "normalize_messages", "sampling_params"]

#: max_tokens when the caller gives none (capped by ``gateway_max_tokens``).
DEFAULT_MAX_TOKENS = 1024


def normalize_messages(messages: Sequence[BaseModel | Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as plain dicts with null values dropped and ``content`` always present
    (``""`` when null or missing). Raises TypeError for an item that is neither a model nor
    a mapping."""
    out = []
    for i, message in enumerate(messages):
        if isinstance(message, BaseModel):
            data = message.model_dump(exclude_none=True)
        elif isinstance(message, Mapping):
            data = {k: v for k, v in message.items() if v is not None}
        else:
            raise TypeError(f"messages[{i}] must be a mapping, got {type(message).__name__}")
        data.setdefault("content", "")
        out.append(data)
    return out


def sampling_params(*, temperature: float | None, top_p: float | None,
                    max_tokens: int | None, seed: int | None, stop: str | list[str] | None,
                    cap: int) -> SamplingParams:
    """The sampling parameters of a request (OpenAI defaults: temperature 1, top_p 1).
    Raises ApiError 422 naming ``max_tokens`` when it is over ``cap``."""
    if max_tokens is not None and max_tokens > cap:
        raise ApiError(422, "invalid_request", f"max_tokens {max_tokens} is over this "
                       f"gateway's limit of {cap}", field="body.max_tokens")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    return SamplingParams(
        temperature=1.0 if temperature is None else float(temperature),
        top_p=1.0 if top_p is None else float(top_p),
        max_tokens=max_tokens if max_tokens is not None else min(DEFAULT_MAX_TOKENS, cap),
        seed=seed, stop=tuple(stops))
