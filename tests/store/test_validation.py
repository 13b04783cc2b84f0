"""Every validation error names the event index and field; nothing is stored."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from store import errors
from store.eventlog import EventStore
from store.settings import Settings
from store.validation import validate_batch
from tests.factories import episode_started

GOOD_CALL: dict[str, Any] = {
    "type": "llm_called",
    "call_id": "c1",
    "prompt_ids": [1, 2, 3],
    "response_ids": [4, 5],
    "logprobs": [-0.5, -0.25],
}


def call(**changes: Any) -> dict[str, Any]:
    return {**GOOD_CALL, **changes}


CASES = [
    (call(logprobs=[-0.5]), "logprobs", "equal length"),
    (call(prompt_ids=[1, -2]), "prompt_ids", "non-negative"),
    (call(response_ids=[4, 2**31]), "response_ids", "int32"),
    (call(prompt_ids=[1.5, 2.0]), "prompt_ids", "integers"),
    (call(prompt_ids=[[1, 2]]), "prompt_ids", "one-dimensional"),
    (call(logprobs=[float("nan"), -1.0]), "logprobs", "NaN"),
    (call(logprobs=[0.5, -1.0]), "logprobs", "<= 0"),
    (call(call_id=""), "call_id", "at least 1"),
    (call(surprise=1), "surprise", "Extra inputs"),
    ({"type": "no_such_event"}, "type", "unknown event type"),
    ({"call_id": "x"}, "type", "unknown event type"),
    ({"type": {}}, "type", "unknown event type"),
    ({"type": ["llm_called"]}, "type", "unknown event type"),
    ({"type": "episode_finished", "status": "exploded"}, "status", "completed"),
    ({"type": "checkpoint_created", "checkpoint_id": "k", "position_key": "t3"},
     "position_key", "pattern"),
    ({"type": "reward_assigned", "value": float("inf")}, "value", "finite"),
    ({"type": "episode_started", "group_id": "g"}, "run_id", "required"),
    ({"type": "run_created", "run_id": "r", "config": {"egpo": {"variant": "other"}}},
     "config.egpo.variant", "clip"),
    ({"type": "attempt_failed", "checkpoint_id": "k", "position_key": "turn_1",
      "retry_index": -1}, "retry_index", "greater than or equal"),
    ({"type": "attempt_failed", "checkpoint_id": "k", "position_key": "turn_1",
      "retry_index": 2**31}, "retry_index", "at most 2147483647"),
    (call(policy_version=2**31), "policy_version", "32-bit"),
    ({"type": "run_created", "run_id": "r", "config": {"rollout": {"max_tokens": 2**40}}},
     "config.rollout.max_tokens", "at most"),
]


@pytest.mark.parametrize(("bad", "field", "words"), CASES)
def test_invalid_event_is_named_and_nothing_stored(
    store: EventStore, bad: dict[str, Any], field: str, words: str
) -> None:
    stream = f"ep-{uuid.uuid4().hex}"
    with pytest.raises(errors.ValidationError) as info:
        store.append(stream, [episode_started(), GOOD_CALL, bad])
    assert info.value.event_index == 2
    assert info.value.field == field
    assert words.lower() in str(info.value).lower()
    assert store.stream_version(stream) == 0


def test_batch_limits(pg_url: str, tmp_path: Any) -> None:
    from store.db import Database

    settings = Settings(database_url=pg_url, data_dir=tmp_path, max_batch_events=3,
                        max_tokens_per_array=4, max_event_bytes=2048)
    store = EventStore(Database(pg_url, max_size=1), settings)
    stream = f"ep-{uuid.uuid4().hex}"
    try:
        with pytest.raises(errors.ValidationError, match="at least one"):
            store.append(stream, [])
        with pytest.raises(errors.ValidationError, match="at most 3"):
            store.append(stream, [GOOD_CALL] * 4)
        with pytest.raises(errors.ValidationError) as info:
            store.append(stream, [GOOD_CALL, call(prompt_ids=list(range(5)))])
        assert (info.value.event_index, info.value.field) == (1, "prompt_ids")
        with pytest.raises(errors.ValidationError, match="over the limit of 2048"):
            store.append(stream, [{"type": "tool_returned", "name": "x", "output": "y" * 3000}])
        eid = str(uuid.uuid4())
        with pytest.raises(errors.ValidationError, match="also used by event 0"):
            store.append(stream, [call(event_id=eid), call(event_id=eid, call_id="c2")])
        with pytest.raises(errors.ValidationError, match="list of events"):
            store.append(stream, GOOD_CALL)  # type: ignore[arg-type]
        assert store.stream_version(stream) == 0
    finally:
        store.close()


@pytest.mark.parametrize("expected", [-1, "latest", 1.5, True, None])
def test_bad_expected_version(store: EventStore, expected: Any) -> None:
    with pytest.raises(errors.ValidationError, match="expected_version"):
        store.append(f"ep-{uuid.uuid4().hex}", [GOOD_CALL], expected)


@pytest.mark.parametrize("stream", ["", "x" * 201, None, 7, "ep-\x00-1"])
def test_bad_stream_id(store: EventStore, stream: Any) -> None:
    with pytest.raises(errors.ValidationError, match="stream id"):
        store.append(stream, [GOOD_CALL])


def test_read_arguments(store: EventStore) -> None:
    with pytest.raises(errors.ValidationError, match="limit"):
        store.read_all(limit=0)
    with pytest.raises(errors.ValidationError, match="from_version"):
        store.read_stream("x", from_version=0)
    assert store.read_stream(f"missing-{uuid.uuid4().hex}") == []


def test_a_value_postgres_cannot_hold_is_a_validation_error(store: EventStore) -> None:
    stream = f"ep-{uuid.uuid4().hex}"
    started = {"type": "episode_started", "run_id": "run\x00x", "group_id": "g"}
    with pytest.raises(errors.ValidationError, match="NUL|0x00"):
        store.append(stream, [started])
    assert store.stream_version(stream) == 0
    # NUL inside a JSON payload is refused too: PostgreSQL could store its escape but no
    # query could extract a field of that row afterwards.
    with pytest.raises(errors.ValidationError, match="NUL") as info:
        store.append(stream, [episode_started(),
                              {"type": "tool_returned", "name": "x", "output": "a\x00b"}])
    assert (info.value.event_index, info.value.field) == (1, "output")
    assert store.stream_version(stream) == 0


def test_egpo_config_that_would_fail_at_training_is_refused_at_creation(
        store: EventStore) -> None:
    from store.events import RunCreated

    with pytest.raises(errors.ValidationError, match="egpo.lam") as info:
        store.append("run-egpo-bad", [{"type": "run_created", "run_id": "egpo-bad",
                                       "config": {"egpo": {"lam": 2.5, "alpha": 2.0}}}])
    assert info.value.field.startswith("config.egpo")
    assert store.stream_version("run-egpo-bad") == 0
    # The paper's form has no such bound, and lam 0 (plain GRPO) needs none.
    RunCreated(run_id="ok", config={"egpo": {"lam": 2.5, "alpha": 2.0, "variant": "paper"}})
    RunCreated(run_id="ok", config={"egpo": {"lam": 0, "alpha": 0.5}})


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(("value", "refused"), [
    (_nested(63), None),  # arguments (1), its "v" (2), 63 lists: 64 levels
    (_nested(64), "nested deeper than 64"),
    ({"a": _nested(62), "b": [[[[]]]] * 40}, None),  # many brackets, none too deep
    (2**63 - 1, None),
    (-(2**63 - 1), None),
    (2**63, "integer out of range"),
    ([1, {"x": -(2**63)}], "integer out of range"),
    (0.00012345678901234567, None),  # a float with 20 digits in a row
    ("1" * 40, None),  # digits in a string
    ("[[[[" * 30, None),  # brackets in a string
    (float("nan"), "finite"),
])
def test_the_text_shortcut_decides_as_the_walk(value: Any, refused: str | None) -> None:
    """The JSON text settles depth and integers for most events; whatever it cannot rule out
    is walked, so its answer is the walk's, whatever the text holds."""
    event = {"type": "tool_returned", "name": "calculator", "arguments": {"v": value}}
    if refused is None:
        assert validate_batch([event], Settings())[0].arguments == {"v": value}
    else:
        with pytest.raises(errors.ValidationError, match=refused) as info:
            validate_batch([event], Settings())
        assert info.value.field is not None and info.value.field.startswith("arguments.v")
