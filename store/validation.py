"""Validation of a batch before anything is written: one bad event rejects the batch.

Errors name the event's index in the batch and the field path, e.g.
``event 3, field 'logprobs': logprobs has 5 entries but response_ids has 6``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pydantic
from pydantic import BaseModel

from store.errors import ValidationError
from store.events import EVENT_TYPES, MAX_INT, Event, parse_event
from store.settings import Settings

__all__ = ["validate_batch", "coerce_event"]


def _field_path(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts) or "(event)"


def coerce_event(item: Event | Mapping[str, Any], index: int) -> Event:
    """An event model from a model or a mapping ``{"type": ..., <fields>}``.

    Raises ``ValidationError`` naming ``index`` and the field for an unknown type or a field
    that does not fit the type's schema.
    """
    if isinstance(item, Event):
        return item
    if not isinstance(item, Mapping):
        raise ValidationError(
            f"an event must be an Event or a mapping, got {type(item).__name__}",
            event_index=index,
        )
    type_name = item.get("type")
    if not isinstance(type_name, str) or type_name not in EVENT_TYPES:
        raise ValidationError(
            f"unknown event type {type_name!r}; known: {', '.join(sorted(EVENT_TYPES))}",
            event_index=index,
            field="type",
        )
    fields = {k: v for k, v in item.items() if k != "type"}
    try:
        return parse_event(type_name, fields)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        raise ValidationError(
            first["msg"], event_index=index, field=_field_path(tuple(first["loc"]))
        ) from None


def validate_batch(
    events: Sequence[Event | Mapping[str, Any]], settings: Settings
) -> list[Event]:
    """Check a batch against the schemas and the size limits of ``settings``.

    Returns the events as models. Raises ``ValidationError`` for an empty or oversized batch,
    an unknown type, a schema violation, a count or version above ``MAX_INT``, a token array
    longer than
    ``max_tokens_per_array``, or an event id used twice in the batch. (The stored size of an
    event, ``max_event_bytes``, is checked when it is encoded, see ``EventStore.append``.)
    """
    if isinstance(events, (str, bytes, Mapping)) or not isinstance(events, Sequence):
        raise ValidationError("events must be a list of events", field="events")
    if not events:
        raise ValidationError("a batch needs at least one event", field="events")
    if len(events) > settings.max_batch_events:
        raise ValidationError(
            f"a batch holds at most {settings.max_batch_events} events, got {len(events)}",
            field="events",
        )
    models = [coerce_event(item, i) for i, item in enumerate(events)]
    seen: dict[Any, int] = {}
    for i, event in enumerate(models):
        for name, arr in event.token_payloads().items():
            if len(arr) > settings.max_tokens_per_array:
                raise ValidationError(
                    f"{len(arr)} entries exceed the limit of {settings.max_tokens_per_array}",
                    event_index=i,
                    field=name,
                )
        if event.event_id is not None:
            if event.event_id in seen:
                raise ValidationError(
                    f"event id {event.event_id} is also used by event {seen[event.event_id]}",
                    event_index=i,
                    field="event_id",
                )
            seen[event.event_id] = i
        too_large = _int_over_range(event)
        if too_large is not None:
            raise ValidationError(
                f"must be at most {MAX_INT} (the projections store it as a 32-bit integer)",
                event_index=i,
                field=too_large,
            )
    return models


def _int_over_range(model: BaseModel, prefix: str = "") -> str | None:
    """The dotted name of the first integer field of ``model`` (or of a model inside it)
    above ``MAX_INT``, or None. Free-form dicts and lists are not looked into. Checked on
    append only: reading keeps accepting what older versions stored."""
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_INT:
            return prefix + name
        if isinstance(value, BaseModel):
            inner = _int_over_range(value, f"{prefix}{name}.")
            if inner is not None:
                return inner
    return None
