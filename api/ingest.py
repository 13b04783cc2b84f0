"""Appending a batch received over HTTP: decode base64 token fields, rebuild prompts given by
reference (``api.prompt_refs``), keep each stream to the event types it may hold, hand the
batch to the store (which validates it whole: one bad event rejects the batch and nothing is
stored)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, cast

from api.prompt_refs import resolve_prompt_refs
from api.tokens import decode_event_tokens
from store.errors import ValidationError
from store.eventlog import AppendResult, EventStore, ExpectedVersion
from store.events import Event

__all__ = ["EPISODE_TYPES", "RUN_TYPES", "append_batch"]

#: Types that belong to a run's own stream; episodes hold every other type.
RUN_TYPES = frozenset({"run_created", "policy_updated", "policy_served"})
EPISODE_TYPES = frozenset({
    "episode_started", "llm_called", "tool_returned", "checkpoint_created", "attempt_failed",
    "rolled_back", "reward_assigned", "episode_finished",
})


def append_batch(store: EventStore, stream_id: str, events: Sequence[Mapping[str, Any]], *,
                 expected_version: ExpectedVersion, allowed: Collection[str]) -> AppendResult:
    """Append ``events`` (dicts as received) to ``stream_id``. Raises
    ``store.errors.ValidationError`` naming the event index and field for a type this stream
    may not hold or a token field that is not a list nor valid base64, and whatever
    ``EventStore.append`` raises (validation, conflict, idempotency)."""
    decoded = []
    for index, event in enumerate(events):
        if not isinstance(event, Mapping):
            raise ValidationError(f"an event must be a JSON object, got "
                                  f"{type(event).__name__}", event_index=index)
        kind = event.get("type")
        if not isinstance(kind, str):
            raise ValidationError(f"type must be a string naming the event type, got "
                                  f"{kind!r:.60}", event_index=index, field="type")
        if kind in RUN_TYPES | EPISODE_TYPES and kind not in allowed:
            raise ValidationError(
                f"a {kind} event does not belong in this stream; it takes "
                f"{', '.join(sorted(allowed))}",
                event_index=index, field="type",
            )
        decoded.append(decode_event_tokens(event, index))
    resolved = resolve_prompt_refs(decoded)
    # The store validates mappings as it does models (store.validation.coerce_event).
    return store.append(stream_id, cast(Sequence[Event], resolved), expected_version)
