"""Validation of a batch before anything is written: one bad event rejects the batch.

Errors name the event's index in the batch and the field path, e.g.
``event 3, field 'logprobs': logprobs has 5 entries but response_ids has 6``.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pydantic
from pydantic import BaseModel

from store.errors import ValidationError
from store.events import EVENT_TYPES, MAX_INT, TOKEN_FIELDS, Event, parse_event
from store.settings import Settings

__all__ = [
    "MAX_DEPTH",
    "MAX_JSON_INT",
    "check_json",
    "check_text",
    "check_value",
    "storable_text",
    "coerce_event",
    "validate_batch",
]

#: The deepest nesting of lists and objects a free-form field may hold (an event's own
#: fields are level 1).
MAX_DEPTH = 64
#: The largest magnitude of an integer anywhere in an event: what a signed 64-bit integer
#: holds, so that every reader (PostgreSQL's jsonb, numpy, Parquet, other languages) keeps it.
MAX_JSON_INT = 2**63 - 1

# NUL cannot be stored in PostgreSQL text nor jsonb; a lone surrogate is not a character at
# all and cannot be encoded as UTF-8.
_BAD_CHAR = re.compile("[\x00\ud800-\udfff]")


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
    an unknown type, a schema violation, a value ``check_value`` refuses (a NUL or lone
    surrogate in a string, nesting deeper than ``MAX_DEPTH``, a non-finite number, an
    integer beyond 64 bits), a count or version above ``MAX_INT``, a token array
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
        bad = check_value(event)
        if bad is not None:
            raise ValidationError(bad[1], event_index=i, field=bad[0])
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
    values = model.__dict__  # the field values, read without getattr's cost per field
    for name in _field_names(type(model)):
        value = values[name] if name in values else getattr(model, name)
        if type(value) in _NEITHER_INT_NOR_MODEL:
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_INT:
            return prefix + name
        if isinstance(value, BaseModel):
            inner = _int_over_range(value, f"{prefix}{name}.")
            if inner is not None:
                return inner
    return None


# The types most fields hold, none an int (bool is refused below anyway) or a model: a set
# lookup skips them without two isinstance calls each.
_NEITHER_INT_NOR_MODEL = frozenset({str, float, bool, type(None), list, dict, tuple,
                                    np.ndarray, uuid.UUID, dt.datetime})

_FIELD_NAMES: dict[type[BaseModel], tuple[str, ...]] = {}


def _field_names(cls: type[BaseModel]) -> tuple[str, ...]:
    """The field names of a model class in their declared order (cached per class: the
    ``model_fields`` lookup costs more than a small event's whole check)."""
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(cls.model_fields)
    return names


def check_text(text: str) -> str | None:
    """Why ``text`` cannot be stored (a NUL character or a lone surrogate), or None."""
    m = _BAD_CHAR.search(text)
    if m is None:
        return None
    char = m.group()
    what = "a NUL character (\\u0000)" if char == "\x00" else (
        f"a lone surrogate (\\u{ord(char):04x})")
    return f"must not contain {what}; found at character {m.start()}"


def storable_text(text: str) -> str:
    """``text`` with what ``check_text`` refuses replaced: NUL by U+FFFD, a lone surrogate
    by "?". For text a process makes itself (a model's decoded output, a tool's output),
    which must be recorded whatever it holds; input from clients is refused instead."""
    if check_text(text) is None:
        return text
    return text.replace("\x00", "\ufffd").encode("utf-8", "replace").decode("utf-8")


def check_value(model: BaseModel) -> tuple[str, str] | None:
    """The first value of ``model`` (its fields, the models inside it, every string, key,
    number, list and object of its free-form fields) that the store refuses, as
    ``(field path, reason)``, or None when every value can be stored and read back as given.

    Refused: a string or object key holding NUL or a lone surrogate, lists and objects nested
    deeper than ``MAX_DEPTH``, a NaN or infinite number, an integer beyond ``MAX_JSON_INT``.
    Token payloads (numpy arrays) are checked by their own validators."""
    if _plainly_storable(model):
        return None
    for name in type(model).model_fields:
        found = _check(getattr(model, name), name, 1)
        if found is not None:
            return found
    return None


def _plainly_storable(model: BaseModel) -> bool:
    """A fast, conservative ``check_value(model) is None``: True only when the event's JSON
    text has no NUL escape, lone surrogate or non-finite number, and its lists and objects
    nest at most ``MAX_DEPTH`` deep holding no integer past ``MAX_JSON_INT``. False sends the
    event to the exact walk, which names the field (and accepts what this merely could not
    rule out)."""
    # The field values as validated (not to_data(): its JSON mode writes NaN as null).
    values = model.__dict__  # read as _int_over_range does
    data = {name: values[name] if name in values else getattr(model, name)
            for name in _field_names(type(model)) if name not in _NOT_JSON}
    try:
        text = _CHECK_JSON.encode(data)
        encoded = text.encode()  # a lone surrogate cannot be encoded
    except (TypeError, ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
        return False
    if "\\u0000" in text:
        return False
    # The text settles nesting and integers without walking the values when it can: a list
    # or object at depth MAX_DEPTH + 1 opens MAX_DEPTH + 2 brackets in it (the outer object
    # is one), and an integer past MAX_JSON_INT has 19 digits or more. Whatever else has as
    # many (brackets or digits in a string, a float's decimals) only makes it walk.
    if (text.count("[") + text.count("{") <= MAX_DEPTH + 1
            and _LONG_NUMBER not in encoded.translate(_DIGITS_AS_ZERO)):
        return True
    return _nested_ok(data, 0)


# The check's JSON text: one encoder for every event, not one made per call as json.dumps
# does; a circular value raises RecursionError instead of ValueError, refused the same way.
_CHECK_JSON = json.JSONEncoder(ensure_ascii=False, allow_nan=False, check_circular=False,
                               separators=(",", ":"))
# The fields kept out of an event's JSON data.
_NOT_JSON = frozenset({"event_id", "occurred_at", *TOKEN_FIELDS})
# Every digit as 0 and every other byte as a space: a run of 19 digits is then b"0" * 19
# (a byte-table translation and a substring search, both in C, far cheaper than a regex).
_DIGITS_AS_ZERO = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
_LONG_NUMBER = b"0" * 19


def _nested_ok(value: dict[Any, Any] | list[Any] | tuple[Any, ...], depth: int) -> bool:
    if depth > MAX_DEPTH:
        return False
    for item in value.values() if type(value) is dict else value:
        kind = type(item)
        if kind is dict or kind is list or kind is tuple:
            if not _nested_ok(item, depth + 1):
                return False
        elif kind is int and not -MAX_JSON_INT <= item <= MAX_JSON_INT:
            return False
    return True


def check_json(value: Any) -> tuple[str, str] | None:
    """What ``check_value`` says of a plain JSON value (a request body before it becomes
    events): the first refused value as ``(field path, reason)``, or None."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            if isinstance(key, str) and check_text(key) is not None:
                return repr(key), f"object key {check_text(key)}"
            found = _check(item, str(key), 1)
            if found is not None:
                return found
        return None
    return _check(value, "(body)", 1)


def _check(value: Any, path: str, depth: int) -> tuple[str, str] | None:
    if isinstance(value, str):
        why = check_text(value)
        return None if why is None else (path, why)
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        if abs(value) > MAX_JSON_INT:
            return path, f"integer out of range: must lie within +/-{MAX_JSON_INT} (64 bits)"
        return None
    if isinstance(value, float):
        if not math.isfinite(value):
            return path, f"must be a finite number, got {value}"
        return None
    if isinstance(value, np.ndarray):
        return None
    if isinstance(value, BaseModel):
        for name in type(value).model_fields:
            found = _check(getattr(value, name), f"{path}.{name}", depth)
            if found is not None:
                return found
        return None
    if isinstance(value, Mapping | list | tuple):
        if depth > MAX_DEPTH:
            return path, f"nested deeper than {MAX_DEPTH} levels of lists and objects"
        if isinstance(value, Mapping):
            for key, item in value.items():
                if isinstance(key, str):
                    why = check_text(key)
                    if why is not None:
                        return f"{path}.{key!r}", f"object key {why}"
                found = _check(item, f"{path}.{key}", depth + 1)
                if found is not None:
                    return found
        else:
            for i, item in enumerate(value):
                found = _check(item, f"{path}[{i}]", depth + 1)
                if found is not None:
                    return found
    return None
