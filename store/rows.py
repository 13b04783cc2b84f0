"""Mapping between event models and ``events`` rows: hashing, delta encoding, decoding.

No database access here: ``store.recorder`` fetches and writes the rows.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from store import codec
from store.events import Event, LLMCalled, parse_event

__all__ = [
    "LogPosition",
    "RecordedEvent",
    "EventRow",
    "same_content",
    "data_json",
    "stored_size",
    "LLMCallMemory",
    "encode_llm_call",
    "Decoder",
    "ROW_COLUMNS",
    "safe_data",
]

def safe_data(column: str) -> str:
    """SQL for the JSON in ``column`` that field extraction (``->``, ``->>``) can always read.

    PostgreSQL cannot turn the JSON escape ``\\u0000`` into text, so any field extraction
    from a row holding one fails, and with it every listing that reaches the row. Appends
    refuse NUL since (``store.validation``), but events are immutable and a log written
    before may hold such rows: here they read with U+FFFD in place of each NUL (a literal
    backslash before the escape stays valid JSON too). Rows without one are read as is."""
    return (f"(CASE WHEN strpos({column}::text, '\\u0000') > 0"
            f" THEN replace({column}::text, '\\u0000', '\\ufffd')::json ELSE {column} END)")


#: Columns selected by every reader, in this order (see ``Decoder.decode``). ``data`` is read
#: whole and parsed in Python, where ``store.db``'s JSON loader puts U+FFFD in place of a NUL
#: escape (a row stored before appends refused NUL), so that replay and projections can write
#: it; the scan for the escape runs in C over bytes, not in SQL over every row read.
ROW_COLUMNS = (
    "position, tx_id::text::bigint AS tx_id, event_id, stream_id, stream_version, type,"
    " schema_version, run_id, group_id, agent, data, prompt_ids,"
    " prompt_base_version, prompt_prefix_len, response_ids, logprobs, occurred_at, recorded_at"
)

# Key in a stored llm_called's JSON data that says its messages are a delta.
MESSAGES_BASE_KEY = "messages_base"


@dataclass(frozen=True, order=True, slots=True)
class LogPosition:
    """A reading checkpoint in the global log: the writing transaction, then the position.

    Readers read in (tx_id, position) order, which is commit order for every transaction
    older than the oldest one still running. ``str()`` gives ``"tx:position"``.
    """

    tx_id: int
    position: int

    def __str__(self) -> str:
        return f"{self.tx_id}:{self.position}"

    @classmethod
    def parse(cls, text: str) -> LogPosition:
        """Parse ``"tx:position"``; raises ``ValueError`` naming the bad text."""
        try:
            tx, pos = text.split(":")
            return cls(int(tx), int(pos))
        except ValueError:
            raise ValueError(f"not a log position (want 'tx:position'): {text!r}") from None


START = LogPosition(0, 0)


@dataclass(frozen=True, slots=True)
class RecordedEvent:
    """An event as stored: where it sits in the log and in its stream, and the event."""

    position: int
    tx_id: int
    stream_id: str
    stream_version: int
    event: Event
    run_id: str | None
    group_id: str | None
    agent: str | None
    recorded_at: dt.datetime

    @property
    def type(self) -> str:
        return self.event.type

    @property
    def log_position(self) -> LogPosition:
        return LogPosition(self.tx_id, self.position)


def _canonical(data: Any) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def same_content(a: Event, b: Event) -> bool:
    """Whether two events carry the same content (ids and times aside): what an idempotent
    retry must repeat. Dicts compare by value, so key order does not matter."""
    if a.type != b.type or a.to_data() != b.to_data():
        return False
    pa, pb = a.token_payloads(), b.token_payloads()
    return pa.keys() == pb.keys() and all(np.array_equal(pa[k], pb[k]) for k in pa)


def data_json(data: dict[str, Any]) -> str:
    """The JSON text stored for an event's data; ``ValueError`` when it is not JSON."""
    try:
        return _DATA_JSON.encode(data)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"data is not JSON-serialisable: {exc}") from None


# What json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False) makes,
# with one encoder for every event instead of one made per call.
_DATA_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def stored_size(row: EventRow) -> int:
    """Bytes an event takes in its row: JSON text plus token payloads as stored."""
    text = row.data_json
    # An ASCII text's UTF-8 takes a byte per character: no need to encode it to count.
    return (len(text) if text.isascii() else len(text.encode())) + sum(
        len(b) for b in (row.prompt_ids, row.response_ids, row.logprobs) if b is not None
    )


@dataclass(slots=True)
class LLMCallMemory:
    """What later calls of a stream may use as a delta base: an earlier ``llm_called``'s
    prompt followed by its generation, and its messages followed by its response."""

    version: int
    sequence: np.ndarray
    messages: list[dict[str, Any]]


@dataclass(slots=True)
class EventRow:
    """One row to insert (everything but position, tx_id and recorded_at)."""

    event_id: uuid.UUID
    stream_id: str
    stream_version: int
    type: str
    schema_version: int
    run_id: str | None
    group_id: str | None
    agent: str | None
    data: dict[str, Any]
    data_json: str = ""
    prompt_ids: bytes | None = None
    prompt_base_version: int | None = None
    prompt_prefix_len: int | None = None
    prompt_len: int | None = None
    response_ids: bytes | None = None
    logprobs: bytes | None = None
    occurred_at: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.UTC))


def _common_messages(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def encode_llm_call(
    row: EventRow,
    event: LLMCalled,
    candidates: Sequence[LLMCallMemory],
    *,
    min_prefix: int,
) -> LLMCallMemory:
    """Fill the token columns of ``row`` from ``event``, as a delta of the best candidate
    when one shares at least ``min_prefix`` prompt tokens. Returns what later calls of the
    stream may use as their base."""
    prompt = event.prompt_ids
    delta = codec.choose_delta(
        prompt, [(c.version, c.sequence) for c in candidates], min_prefix=min_prefix
    )
    messages = row.data["messages"]
    if delta is None:
        row.prompt_ids = codec.pack_ids(prompt)
    else:
        base = next(c for c in candidates if c.version == delta.base_version)
        row.prompt_ids = codec.pack_ids(delta.suffix)
        row.prompt_base_version = delta.base_version
        row.prompt_prefix_len = delta.prefix_len
        shared = _common_messages(messages, base.messages)
        if shared:
            data = dict(row.data)
            data["messages"] = messages[shared:]
            data[MESSAGES_BASE_KEY] = {"version": delta.base_version, "count": shared}
            row.data = data
    row.prompt_len = len(prompt)
    row.response_ids = codec.pack_ids(event.response_ids)
    row.logprobs = codec.pack_logprobs(event.logprobs)
    sequence = np.concatenate([prompt, event.response_ids]).astype(np.int32, copy=False)
    full_messages = list(messages) + ([event.response] if event.response else [])
    return LLMCallMemory(row.stream_version, sequence, full_messages)


#: The JSON fields of a stored ``llm_called`` (``LLMCalled.to_data``).
_LLM_CALL_FIELDS = frozenset({"agent", "call_id", "messages", "tools", "response",
                              "finish_reason", "policy_version", "latency_ms", "usage"})


#: The length bound of ``LLMCalled``'s names (``agent``, ``call_id``), read from the model.
_NAME_MAX = next(m.max_length for m in LLMCalled.model_fields["call_id"].metadata
                 if hasattr(m, "max_length"))


def _name_ok(value: Any) -> bool:
    return type(value) is str and 1 <= len(value) <= _NAME_MAX


def _dicts(value: Any) -> bool:
    return type(value) is list and all(type(v) is dict for v in value)


def _stored_llm_call(data: dict[str, Any], own_messages: Any) -> dict[str, Any] | None:
    """The fields of a stored ``llm_called`` as its model holds them, when the row's own
    JSON (``own_messages``: the messages the row stores, not those taken from its delta
    base) has every type and bound ``LLMCalled`` checks; None when it has not."""
    if not data.keys() <= _LLM_CALL_FIELDS or not _name_ok(data.get("call_id")) \
            or not _name_ok(data.get("agent", "main")) or not _dicts(own_messages):
        return None
    tools = data.get("tools")
    response = data.get("response", {})
    finish = data.get("finish_reason")
    version = data.get("policy_version", 0)
    latency = data.get("latency_ms")
    usage = data.get("usage")
    if (tools is not None and not _dicts(tools)) or type(response) is not dict \
            or (finish is not None and type(finish) is not str) \
            or type(version) is not int or version < 0 \
            or (latency is not None and type(latency) not in (int, float)) \
            or (usage is not None and type(usage) is not dict):
        return None
    fields = dict(data)
    fields.setdefault("agent", "main")
    fields.setdefault("messages", [])
    fields["response"] = response
    fields["policy_version"] = version
    if type(latency) is int:
        fields["latency_ms"] = float(latency)
    return fields


class Decoder:
    """Turns fetched rows back into events, expanding prompt and message deltas.

    Rows must be fed so that a delta's base comes first (stream version order within a
    stream); bases fetched only to decode others are fed with ``remember``.

    By default every event is validated as ``parse_event`` does on append. With ``trusted``
    (the projections, which read their own log in bulk), an ``llm_called`` of the current
    schema version is checked only for what its row stores itself: the types and bounds of
    its fields and of the messages it adds to its delta base, which were checked in the
    base's own row. Its history is not validated once per later call (quadratic in the
    turns), its token payloads are taken as stored (the int32 and float32 arrays append
    checked), and the messages it shares with its base are the same dicts, not copies
    (events are read-only). A row that fails those checks is validated in full, which
    raises pydantic's error as the default does.
    """

    def __init__(self, *, trusted: bool = False) -> None:
        self._memory: dict[tuple[str, int], LLMCallMemory] = {}
        self._trusted = trusted

    def missing_bases(self, rows: Iterable[Any]) -> set[tuple[str, int]]:
        """(stream, version) of delta bases that these rows need and the decoder lacks."""
        wanted: set[tuple[str, int]] = set()
        present = {(r["stream_id"], r["stream_version"]) for r in rows}
        for r in rows:
            base = r["prompt_base_version"]
            if base is not None:
                key = (r["stream_id"], base)
                if key not in self._memory and key not in present:
                    wanted.add(key)
        return wanted

    def memory(self, stream_id: str, version: int) -> LLMCallMemory:
        """The decoded prompt+response of an ``llm_called`` fed earlier."""
        return self._memory[(stream_id, version)]

    def remember(self, row: Any) -> None:
        """Decode a base row only for its token memory."""
        self.decode(row)

    def decode(self, row: Any) -> RecordedEvent:
        """The ``RecordedEvent`` of one fetched row (a mapping with ``ROW_COLUMNS``)."""
        data = dict(row["data"])
        tokens: dict[str, Any] | None = None
        own_messages: Any = None
        if row["type"] == LLMCalled.type:
            stream = row["stream_id"]
            suffix = codec.unpack_ids(row["prompt_ids"])
            base_version = row["prompt_base_version"]
            base = None
            if base_version is not None:
                base = self._memory.get((stream, base_version))
                if base is None:
                    raise ValueError(
                        f"event {stream}@{row['stream_version']} is a delta of version "
                        f"{base_version}, which was not loaded"
                    )
                prompt = codec.expand_prompt(base.sequence, row["prompt_prefix_len"], suffix)
            else:
                prompt = suffix
            msg_base = data.pop(MESSAGES_BASE_KEY, None)
            own_messages = data.get("messages", [])
            if msg_base is not None:
                if base is None or base.version != msg_base["version"]:
                    raise ValueError(f"event {stream}@{row['stream_version']}: bad message base")
                data["messages"] = base.messages[: msg_base["count"]] + data["messages"]
            response = codec.unpack_ids(row["response_ids"])
            tokens = {
                "prompt_ids": prompt,
                "response_ids": response,
                "logprobs": codec.unpack_logprobs(row["logprobs"]),
            }
            full_messages = list(data["messages"]) + (
                [data["response"]] if data.get("response") else []
            )
            self._memory[(stream, row["stream_version"])] = LLMCallMemory(
                row["stream_version"],
                np.concatenate([prompt, response]).astype(np.int32, copy=False),
                full_messages,
            )
        if tokens is not None and self._trusted \
                and row["schema_version"] == LLMCalled.schema_version:
            fields = _stored_llm_call(data, own_messages)
            if fields is not None:
                for name, array in tokens.items():
                    array.flags.writeable = False
                    fields[name] = array
                fields["event_id"] = row["event_id"]
                fields["occurred_at"] = row["occurred_at"]
                return self._recorded(row, LLMCalled.model_construct(**fields))
        event = parse_event(
            row["type"],
            data,
            schema_version=row["schema_version"],
            tokens=tokens,
            event_id=row["event_id"],
            occurred_at=row["occurred_at"],
            stored=True,
        )
        return self._recorded(row, event)

    @staticmethod
    def _recorded(row: Any, event: Event) -> RecordedEvent:
        return RecordedEvent(
            position=row["position"],
            tx_id=row["tx_id"],
            stream_id=row["stream_id"],
            stream_version=row["stream_version"],
            event=event,
            run_id=row["run_id"],
            group_id=row["group_id"],
            agent=row["agent"],
            recorded_at=row["recorded_at"],
        )


