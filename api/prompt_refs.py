"""Prompts given by reference: an ``llm_called`` of a batch may send its ``prompt_ids`` as

    {"extends": k, "suffix": [...] | "<base64>", "keep": n}

meaning: the prompt ids of event ``k`` of the same batch (an earlier ``llm_called``),
followed by that event's ``response_ids``, cut to their first ``n`` tokens (``keep``,
default all of them), followed by ``suffix`` (the tokens the conversation grew by: tool
output, template). A multi-turn agent's prompt is almost always exactly that, so a batch
carrying a whole episode sends each token once instead of once per later turn. The prompt is
rebuilt in full before the store sees the event: what is stored is the same either way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from api.tokens import decode_array
from store.codec import ID_DTYPE
from store.errors import ValidationError

__all__ = ["resolve_prompt_refs"]

_KEYS = {"extends", "suffix", "keep"}


def _ids(value: Any, *, index: int, field: str) -> np.ndarray:
    try:
        arr = np.asarray(value)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise ValueError(f"expected a list of token ids, got shape {arr.shape} "
                             f"dtype {arr.dtype}")
        return arr.astype(np.int64, copy=False)
    except (TypeError, ValueError) as exc:
        raise ValidationError(str(exc), event_index=index, field=field) from None


def resolve_prompt_refs(events: Sequence[Any]) -> list[Any]:
    """The batch with every prompt given by reference rebuilt in full (other events as
    they are; token fields already decoded from base64 where they were strings). Raises
    ``store.errors.ValidationError`` naming the event and field for a reference to a later,
    missing or non-``llm_called`` event, a ``keep`` outside the referenced tokens, unknown
    keys, or a suffix that is not token ids."""
    out = list(events)
    for i, event in enumerate(out):
        if not isinstance(event, Mapping):
            continue
        ref = event.get("prompt_ids")
        if not isinstance(ref, Mapping):
            continue
        unknown = sorted(set(ref) - _KEYS)
        if unknown:
            raise ValidationError(f"unknown key {unknown[0]!r}; a prompt reference takes "
                                  "extends, suffix and keep", event_index=i,
                                  field="prompt_ids")
        k = ref.get("extends")
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < i:
            raise ValidationError(f"extends must name an earlier event of the batch "
                                  f"(0 to {i - 1}), got {k!r}", event_index=i,
                                  field="prompt_ids.extends")
        base_event = out[k]
        if not isinstance(base_event, Mapping) or base_event.get("type") != "llm_called":
            raise ValidationError(f"extends names event {k}, which is not an llm_called",
                                  event_index=i, field="prompt_ids.extends")
        base = np.concatenate([
            _ids(base_event.get("prompt_ids", []), index=k, field="prompt_ids"),
            _ids(base_event.get("response_ids", []), index=k, field="response_ids")])
        keep = ref.get("keep", len(base))
        if isinstance(keep, bool) or not isinstance(keep, int) or not 0 <= keep <= len(base):
            raise ValidationError(f"keep must be an integer from 0 to {len(base)} (the "
                                  f"tokens of event {k}), got {keep!r}", event_index=i,
                                  field="prompt_ids.keep")
        try:
            suffix = decode_array(ref.get("suffix", []), dtype=ID_DTYPE,
                                  field="prompt_ids.suffix")
        except (TypeError, ValueError) as exc:
            raise ValidationError(str(exc), event_index=i,
                                  field="prompt_ids.suffix") from None
        full = np.concatenate([base[:keep], _ids(suffix, index=i, field="prompt_ids.suffix")])
        out[i] = {**event, "prompt_ids": full}
    return out
