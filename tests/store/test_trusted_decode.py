"""A trusted ``Decoder`` (what the projections read with) gives the events the validating
one gives, and a row that breaks the schema is refused by both alike."""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import pydantic
import pytest
from psycopg.rows import dict_row

from store.eventlog import EventStore
from store.events import LLMCalled
from store.rows import MESSAGES_BASE_KEY, ROW_COLUMNS, Decoder
from tests.factories import closing, episode_started, trajectory


def stored_rows(store: EventStore) -> list[dict[str, Any]]:
    stream = f"ep-{uuid.uuid4().hex}"
    calls = trajectory(5, seed=3)
    calls[2] = calls[2].model_copy(update={"latency_ms": 12.5, "usage": {"total": 9},
                                           "tools": [{"type": "function"}]})
    store.append(stream, [episode_started(), *calls, *closing()])
    with store.db.connection() as conn:
        return conn.cursor(row_factory=dict_row, binary=True).execute(
            f"SELECT {ROW_COLUMNS} FROM events WHERE stream_id = %s ORDER BY stream_version",
            (stream,)).fetchall()


def decode_all(rows: list[dict[str, Any]], *, trusted: bool) -> list[Any]:
    decoder = Decoder(trusted=trusted)
    return [decoder.decode(row).event for row in rows]


def test_trusted_decoding_gives_the_validated_events(store: EventStore) -> None:
    rows = stored_rows(store)
    # Later calls store only the messages they add to their delta base.
    assert sum(MESSAGES_BASE_KEY in r["data"] for r in rows) == 4
    checked = decode_all(rows, trusted=False)
    trusted = decode_all(rows, trusted=True)
    for a, b in zip(checked, trusted, strict=True):
        assert type(a) is type(b)
        assert (a.event_id, a.occurred_at) == (b.event_id, b.occurred_at)
        assert a.to_data() == b.to_data()
        assert a.token_payloads().keys() == b.token_payloads().keys()
        for name, array in a.token_payloads().items():
            other = b.token_payloads()[name]
            assert other.dtype == array.dtype and other.tobytes() == array.tobytes()
            assert not other.flags.writeable
    calls = [e for e in trusted if isinstance(e, LLMCalled)]
    assert calls[2].latency_ms == 12.5 and calls[2].usage == {"total": 9}
    assert len(calls[-1].messages) == 9


def test_an_integer_latency_is_a_float_as_validation_makes_it(store: EventStore) -> None:
    rows = stored_rows(store)
    row = dict(rows[1], data={**rows[1]["data"], "latency_ms": 7})
    checked, trusted = (Decoder(trusted=t).decode(row).event for t in (False, True))
    assert isinstance(checked, LLMCalled) and isinstance(trusted, LLMCalled)
    assert type(trusted.latency_ms) is float and trusted.latency_ms == checked.latency_ms == 7.0


BROKEN = {
    "negative policy version": {"policy_version": -1},
    "policy version that is a word": {"policy_version": "three"},
    "empty call id": {"call_id": ""},
    "long agent name": {"agent": "a" * 201},
    "message that is not a mapping": {"messages": ["hello"]},
    "tools that are not a list": {"tools": {"type": "function"}},
    "response that is a list": {"response": []},
    "unknown field": {"temperature": 0.5},
    "finish reason that is a number": {"finish_reason": 3},
    "usage that is text": {"usage": "many"},
    "latency that is text": {"latency_ms": "fast"},
}


@pytest.mark.parametrize("change", BROKEN.values(), ids=list(BROKEN))
@pytest.mark.parametrize("index", [1, 3], ids=["first call", "delta-encoded call"])
def test_a_row_that_breaks_the_schema_is_refused_as_by_validation(
        store: EventStore, change: dict[str, Any], index: int) -> None:
    rows = stored_rows(store)
    assert (MESSAGES_BASE_KEY in rows[index]["data"]) == (index > 1)
    broken = [*rows[:index], dict(rows[index], data={**rows[index]["data"], **change})]
    for trusted in (False, True):
        decoder = Decoder(trusted=trusted)
        for row in broken[:-1]:
            decoder.decode(row)
        with pytest.raises(pydantic.ValidationError) as raised:
            decoder.decode(broken[-1])
        assert raised.value.title == "LLMCalled"


def test_token_arrays_of_a_trusted_event_are_those_stored(store: EventStore) -> None:
    rows = stored_rows(store)
    calls = [e for e in decode_all(rows, trusted=True) if isinstance(e, LLMCalled)]
    expected = trajectory(5, seed=3)
    for got, want in zip(calls, expected, strict=True):
        assert got.prompt_ids.dtype == np.int32 and got.logprobs.dtype == np.float32
        assert got.prompt_ids.tolist() == want.prompt_ids.tolist()
        assert got.response_ids.tolist() == want.response_ids.tolist()
        assert got.logprobs.tobytes() == want.logprobs.tobytes()
