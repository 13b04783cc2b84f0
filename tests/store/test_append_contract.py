"""The append contract, written once and run against every way into the event log:
``EventStore.append`` (one batch, one transaction), ``EventStore.append_many`` (a batch among
others in one shared transaction, checked and written set-wise) and ``EventStore.aappend``
(a coroutine's append, gathered by the store's ``AppendBatcher`` into ``append_many``).

What each promises for a batch: it is stored whole or not at all, in order, with gap-free
stream versions; a retry of stored event ids is answered with the original positions and
stores nothing, whatever version it expects; the same id with other content, in another
stream, or mixed with new ids is refused; a stale expected version conflicts, and of
appenders racing with one expected version one wins; nothing follows an episode's finish;
``episode_started`` only opens an episode and runs' streams hold only run events; a bad
event, stream id, expected version, a NUL, or a batch past the limits is refused naming what
is wrong; an id another writer commits meanwhile is refused; denormalised columns, key
order and delta-encoded prompts read back as sent. Every refusal leaves the stream as it
was. A subject answers with the ``AppendResult`` or raises the error ``append`` raises.

What only one path does (``append_many``'s batches answering one by one, the batcher's
shared and spaced transactions) is tested in ``test_append_many.py``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest

from store import errors
from store.db import Database
from store.eventlog import ANY, NO_STREAM, AppendResult, EventStore, run_stream_id
from store.events import EpisodeFinished, LLMCalled, RewardAssigned, RunCreated, ToolReturned
from store.rows import same_content
from store.settings import Settings
from tests.factories import closing, episode_started, trajectory


def _append(store: EventStore, stream_id: Any, events: Any,
            expected_version: Any = ANY) -> AppendResult:
    return store.append(stream_id, events, expected_version)


def _append_many(store: EventStore, stream_id: Any, events: Any,
                 expected_version: Any = ANY) -> AppendResult:
    [answer] = store.append_many([(stream_id, events, expected_version)])
    if isinstance(answer, Exception):
        raise answer
    return answer


def _aappend(store: EventStore, stream_id: Any, events: Any,
             expected_version: Any = ANY) -> AppendResult:
    return asyncio.run(store.aappend(stream_id, events, expected_version))


@dataclass(frozen=True)
class Subject:
    """One append path under the contract: ``call(store, stream_id, events,
    expected_version)`` appends one batch through it."""

    name: str
    call: Callable[..., AppendResult]

    def on(self, store: EventStore) -> Callable[..., AppendResult]:
        return partial(self.call, store)


SUBJECTS = [Subject("append", _append), Subject("append_many", _append_many),
            Subject("aappend", _aappend)]

Append = Callable[..., AppendResult]
T = TypeVar("T")


@pytest.fixture(params=SUBJECTS, ids=[s.name for s in SUBJECTS])
def subject(request: pytest.FixtureRequest) -> Subject:
    return request.param


@pytest.fixture
def append(subject: Subject, store: EventStore) -> Append:
    return subject.on(store)


def new_stream() -> str:
    return f"ep-{uuid.uuid4().hex}"


def _count(store: EventStore, stream: str) -> int:
    return len(store.read_stream(stream))


def _race(attempts: Sequence[Callable[[], None]]) -> None:
    """Run every attempt in a thread of its own, all released at once."""
    barrier = threading.Barrier(len(attempts))

    def run(attempt: Callable[[], None]) -> None:
        barrier.wait()
        attempt()

    threads = [threading.Thread(target=run, args=(a,)) for a in attempts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# --- stored whole, in order -------------------------------------------------------------


def test_events_read_back_in_order_and_get_ids(store: EventStore, append: Append) -> None:
    stream = new_stream()
    events = [episode_started(), *trajectory(3), *closing()]
    result = append(stream, events, NO_STREAM)
    assert result.version == len(events) and not result.duplicate
    assert len(result.positions) == len(events)
    assert list(result.positions) == sorted(result.positions)
    back = store.read_stream(stream)
    assert [r.stream_version for r in back] == list(range(1, len(events) + 1))
    assert [r.log_position.position for r in back] == list(result.positions)
    assert [r.type for r in back] == [e.type for e in events]
    assert [r.event.event_id for r in back][1:4] == [e.event_id for e in events[1:4]]
    assert all(r.event.event_id is not None for r in back)  # given one where none was sent
    assert all(same_content(r.event, e) for r, e in zip(back, events, strict=True))


def test_run_and_group_are_denormalised_onto_later_events(store: EventStore,
                                                          append: Append) -> None:
    stream = new_stream()
    append(stream, [episode_started(run_id="run-x", group_id="g7")])
    append(stream, [*trajectory(1), *closing()])
    rows = store.read_stream(stream)
    assert {(r.run_id, r.group_id) for r in rows} == {("run-x", "g7")}
    assert rows[1].agent == "main"


def test_key_order_survives_the_round_trip(store: EventStore, append: Append) -> None:
    """Chat templates render dicts in key order, so replay needs the order that was sent."""
    stream = new_stream()
    tool = {"type": "function", "function": {"name": "search", "description": "d",
                                             "parameters": {"type": "object", "required": []}}}
    call = trajectory(1)[0].model_copy(update={"tools": [tool]})
    append(stream, [episode_started(tools=[tool]), call])
    back = store.read_stream(stream)
    assert list(back[1].event.tools[0]["function"]) == ["name", "description", "parameters"]
    assert list(back[0].event.tools[0]["function"]["parameters"]) == ["type", "required"]


def test_prompts_are_stored_as_deltas_and_read_back_whole(store: EventStore,
                                                          append: Append) -> None:
    stream = new_stream()
    calls = trajectory(4, first_prompt=200, tool_output=20)
    append(stream, [episode_started()])
    for call in calls:  # one turn per append, as an agent records them
        append(stream, [call])
    back = [r.event for r in store.read_stream(stream)][1:]
    assert [b.prompt_ids.tolist() for b in back] == [c.prompt_ids.tolist() for c in calls]
    assert [b.messages for b in back] == [c.messages for c in calls]
    with store.db.connection() as conn:
        (stored,) = conn.execute("SELECT sum(length(prompt_ids)) FROM events"
                                 " WHERE stream_id = %s", (stream,)).fetchone()
    assert stored == (200 + 3 * 20) * 4  # the first prompt, then each turn's new tokens


def test_a_time_the_binary_encoders_do_not_take_is_sent_as_psycopg_sends_it(
        store: EventStore, append: Append) -> None:
    """A naive ``occurred_at`` goes as a ``timestamp`` the server reads in its time zone."""
    naive = dt.datetime(2026, 3, 1, 12, 0, 0, 250)
    with store.db.connection() as conn:
        expected = conn.execute("SELECT %s::timestamptz", (naive,)).fetchone()[0]
    stream = new_stream()
    append(stream, [episode_started(occurred_at=naive)])
    assert store.read_stream(stream)[0].event.occurred_at == expected


# --- idempotency ------------------------------------------------------------------------


def test_a_retry_returns_the_original_positions_and_stores_nothing(
        store: EventStore, append: Append) -> None:
    stream = new_stream()
    events = [e.model_copy(update={"event_id": uuid.uuid4()})
              for e in [episode_started(), *trajectory(2), *closing()]]
    first = append(stream, events, NO_STREAM)
    again = append(stream, events, NO_STREAM)  # stale version, finished stream: still a retry
    assert again.duplicate and not first.duplicate
    assert again.positions == first.positions and again.version == first.version
    assert _count(store, stream) == len(events)


def test_a_retry_with_reordered_keys_is_a_retry_and_changed_tokens_are_not(
        store: EventStore, append: Append) -> None:
    stream = new_stream()
    call = trajectory(1)[0]
    append(stream, [episode_started(), call])
    reordered = LLMCalled.model_validate(
        {**{k: v for k, v in reversed(list(call.model_dump().items()))},
         "messages": [dict(reversed(list(m.items()))) for m in call.messages]})
    assert reordered.event_id == call.event_id
    assert append(stream, [reordered]).duplicate
    changed = call.model_copy(update={"response_ids": call.response_ids[::-1].copy()})
    with pytest.raises(errors.IdempotencyError):
        append(stream, [changed])
    assert store.stream_version(stream) == 2


def test_the_same_id_with_other_content_is_refused(store: EventStore,
                                                   append: Append) -> None:
    stream = new_stream()
    eid = uuid.uuid4()
    append(stream, [episode_started(), RewardAssigned(event_id=eid, value=1.0)])
    with pytest.raises(errors.IdempotencyError, match=str(eid)):
        append(stream, [RewardAssigned(event_id=eid, value=0.0)])
    assert _count(store, stream) == 2


def test_the_same_id_in_another_stream_is_refused(store: EventStore, append: Append) -> None:
    eid = uuid.uuid4()
    append(new_stream(), [episode_started(event_id=eid)])
    other = new_stream()
    with pytest.raises(errors.IdempotencyError):
        append(other, [episode_started(event_id=eid)])
    assert store.stream_version(other) == 0


def test_a_batch_mixing_stored_and_new_ids_is_refused(store: EventStore,
                                                      append: Append) -> None:
    stream = new_stream()
    start = episode_started(event_id=uuid.uuid4())
    append(stream, [start])
    with pytest.raises(errors.ValidationError) as info:
        append(stream, [start, EpisodeFinished(status="completed")])
    assert (info.value.event_index, info.value.field) == (1, "event_id")
    assert _count(store, stream) == 1


def while_a_rival_commits(pg_url: str, event_id: uuid.UUID, write: Callable[[], T]) -> T:
    """What ``write`` returns (or raises) when another writer holds an uncommitted row with
    ``event_id`` in a stream of its own, and commits it once ``write``'s INSERT waits on it."""
    with psycopg.connect(pg_url) as rival:
        rival.execute(
            "INSERT INTO events (event_id, stream_id, stream_version, type, schema_version,"
            " data) VALUES (%s, %s, 1, 'tool_returned', 1, %s)",
            (event_id, new_stream(), '{"name": "calculator", "output": "1"}'))
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(write)
            with psycopg.connect(pg_url, autocommit=True) as watcher:
                while not answer.done() and not watcher.execute(
                        "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                        " AND datname = current_database() AND query LIKE '%%INSERT INTO events%%'"
                ).fetchone():
                    time.sleep(0.01)
            rival.commit()
            return answer.result(timeout=60)


def test_an_id_another_writer_commits_meanwhile_is_refused(store: EventStore, append: Append,
                                                           pg_url: str) -> None:
    """The append waits on another writer's uncommitted row with one of its ids; once that
    commits, the batch is refused as a reuse of the id and nothing of it stays."""
    stream = new_stream()
    batch = [episode_started(), *trajectory(1)]
    with pytest.raises(errors.IdempotencyError):
        while_a_rival_commits(pg_url, batch[1].event_id,
                              partial(append, stream, batch, NO_STREAM))
    assert store.stream_version(stream) == 0


# --- versions ---------------------------------------------------------------------------


def test_a_stale_expected_version_conflicts_and_stores_nothing(store: EventStore,
                                                               append: Append) -> None:
    stream = new_stream()
    append(stream, [episode_started()], NO_STREAM)
    append(stream, [RewardAssigned(value=1.0)], 1)
    with pytest.raises(errors.ConflictError) as info:
        append(stream, [EpisodeFinished(status="completed")], 1)
    assert (info.value.actual, info.value.expected) == (2, 1)
    with pytest.raises(errors.ConflictError):
        append(stream, [episode_started()], NO_STREAM)
    assert _count(store, stream) == 2
    assert append(stream, [EpisodeFinished(status="completed")], 2).version == 3


def test_of_appenders_racing_with_one_expected_version_one_wins(store: EventStore,
                                                                append: Append) -> None:
    stream = new_stream()
    append(stream, [episode_started()], NO_STREAM)
    outcomes: list[str] = []

    def attempt(i: int) -> None:
        try:
            append(stream, [RewardAssigned(value=float(i))], 1)
            outcomes.append("ok")
        except errors.ConflictError:
            outcomes.append("conflict")

    _race([partial(attempt, i) for i in range(4)])
    assert sorted(outcomes) == ["conflict"] * 3 + ["ok"]
    assert store.stream_version(stream) == 2


def test_appenders_racing_with_any_all_land_gap_free(store: EventStore,
                                                     append: Append) -> None:
    stream = new_stream()
    append(stream, [episode_started()], NO_STREAM)

    def attempt(i: int) -> None:
        for _ in range(5):
            append(stream, [RewardAssigned(value=float(i))], ANY)

    _race([partial(attempt, i) for i in range(4)])
    assert store.stream_version(stream) == 21
    assert [r.stream_version for r in store.read_stream(stream)] == list(range(1, 22))


# --- where events may go (store.stream_rules) -------------------------------------------


def test_nothing_but_a_late_reward_is_appended_after_episode_finished(
        store: EventStore, append: Append) -> None:
    stream = new_stream()
    append(stream, [episode_started(), EpisodeFinished(status="completed")])
    for batch in ([EpisodeFinished(status="error")],
                  [RewardAssigned(value=1.0), EpisodeFinished(status="error")],
                  [RewardAssigned(value=1.0), ToolReturned(name="calc")]):
        with pytest.raises(errors.ClosedError, match="is finished") as info:
            append(stream, batch)
        assert isinstance(info.value, errors.ConflictError) and info.value.actual == 2
    with pytest.raises(errors.ConflictError):
        append(stream, [RewardAssigned(value=1.0)], 1)  # a stale expected version
    assert store.stream_version(stream) == 2
    # A late reward is the one event a finished episode takes (tests/store/test_late_rewards),
    # at the version it expects or any.
    append(stream, [RewardAssigned(value=1.0)], 2)
    append(stream, [RewardAssigned(value=0.5)])
    assert store.stream_version(stream) == 4
    # A reward opens no stream: it follows its episode's episode_started.
    with pytest.raises(errors.NotFoundError, match="to reward"):
        append(new_stream(), [RewardAssigned(value=1.0)])
    # Nothing may follow a finish inside one batch either.
    third = new_stream()
    with pytest.raises(errors.ValidationError, match="must be the last") as info_order:
        append(third, [episode_started(), EpisodeFinished(status="completed"),
                       RewardAssigned(value=1.0)])
    assert info_order.value.event_index == 2 and store.stream_version(third) == 0


def test_episode_started_only_opens_an_episode(store: EventStore, append: Append) -> None:
    stream = new_stream()
    append(stream, [episode_started(run_id="run-a")])
    with pytest.raises(errors.ValidationError, match="first event") as info:
        append(stream, [episode_started(run_id="someone-elses-run")])
    assert info.value.field == "type"
    fresh = new_stream()
    with pytest.raises(errors.ValidationError, match="first event"):
        append(fresh, [RewardAssigned(value=0.0), episode_started(run_id="x")])
    assert store.stream_version(stream) == 1 and store.stream_version(fresh) == 0


def test_runs_and_episodes_never_share_a_stream(store: EventStore, append: Append) -> None:
    name = f"r{uuid.uuid4().hex[:8]}"
    # An episode cannot take the stream a run of that name would need.
    with pytest.raises(errors.ValidationError, match="streams named 'run-"):
        append(run_stream_id(name), [episode_started()], NO_STREAM)
    with pytest.raises(errors.ValidationError, match="streams named 'run-"):
        append(new_stream(), [RunCreated(run_id=name)], NO_STREAM)
    with pytest.raises(errors.ValidationError, match="own stream"):
        append(run_stream_id("other"), [RunCreated(run_id=name)], NO_STREAM)
    assert store.stream_version(run_stream_id(name)) == 0
    append(run_stream_id(name), [RunCreated(run_id=name)], NO_STREAM)
    assert store.get_run(name).run_id == name


# --- bad input ------------------------------------------------------------------------------

GOOD_CALL: dict[str, Any] = {
    "type": "llm_called",
    "call_id": "c1",
    "prompt_ids": [1, 2, 3],
    "response_ids": [4, 5],
    "logprobs": [-0.5, -0.25],
}


def call(**changes: Any) -> dict[str, Any]:
    return {**GOOD_CALL, **changes}


BAD_EVENTS = [
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


@pytest.mark.parametrize(("bad", "field", "words"), BAD_EVENTS)
def test_an_invalid_event_is_named_and_nothing_is_stored(
        store: EventStore, append: Append, bad: dict[str, Any], field: str, words: str) -> None:
    stream = new_stream()
    with pytest.raises(errors.ValidationError) as info:
        append(stream, [episode_started(), GOOD_CALL, bad])
    assert (info.value.event_index, info.value.field) == (2, field)
    assert words.lower() in str(info.value).lower()
    assert store.stream_version(stream) == 0


def test_a_value_postgres_cannot_hold_is_refused(store: EventStore, append: Append) -> None:
    stream = new_stream()
    started = {"type": "episode_started", "run_id": "run\x00x", "group_id": "g"}
    with pytest.raises(errors.ValidationError, match="NUL|0x00"):
        append(stream, [started])
    assert store.stream_version(stream) == 0
    # NUL inside a JSON payload is refused too: PostgreSQL could store its escape but no
    # query could extract a field of that row afterwards.
    with pytest.raises(errors.ValidationError, match="NUL") as info:
        append(stream, [episode_started(),
                        {"type": "tool_returned", "name": "x", "output": "a\x00b"}])
    assert (info.value.event_index, info.value.field) == (1, "output")
    assert store.stream_version(stream) == 0


@pytest.fixture
def limited(pg_url: str, tmp_path: Path) -> Iterator[EventStore]:
    """A store with small limits: 3 events a batch, 4 tokens an array, 2 KiB an event."""
    settings = Settings(database_url=pg_url, data_dir=tmp_path, max_batch_events=3,
                        max_tokens_per_array=4, max_event_bytes=2048)
    limited = EventStore(Database(pg_url, max_size=1), settings)
    yield limited
    limited.close()


def test_a_batch_past_the_limits_is_refused(limited: EventStore, subject: Subject) -> None:
    append = subject.on(limited)
    stream = new_stream()
    with pytest.raises(errors.ValidationError, match="at least one"):
        append(stream, [])
    with pytest.raises(errors.ValidationError, match="at most 3"):
        append(stream, [GOOD_CALL] * 4)
    with pytest.raises(errors.ValidationError) as info:
        append(stream, [GOOD_CALL, call(prompt_ids=list(range(5)))])
    assert (info.value.event_index, info.value.field) == (1, "prompt_ids")
    with pytest.raises(errors.ValidationError, match="over the limit of 2048") as info:
        append(stream, [{"type": "tool_returned", "name": "x", "output": "y" * 3000}])
    assert info.value.event_index == 0
    eid = str(uuid.uuid4())
    with pytest.raises(errors.ValidationError, match="also used by event 0"):
        append(stream, [call(event_id=eid), call(event_id=eid, call_id="c2")])
    with pytest.raises(errors.ValidationError, match="list of events"):
        append(stream, GOOD_CALL)
    assert limited.stream_version(stream) == 0


@pytest.mark.parametrize("expected", [-1, 2**31, "latest", 1.5, True, None])
def test_a_bad_expected_version_is_refused(store: EventStore, append: Append,
                                           expected: Any) -> None:
    stream = new_stream()
    with pytest.raises(errors.ValidationError, match="expected_version") as info:
        append(stream, [episode_started()], expected)
    assert info.value.field == "expected_version"
    assert store.stream_version(stream) == 0


@pytest.mark.parametrize("stream", ["", "x" * 201, None, 7, "ep-\x00-1", "ep-\ud800"])
def test_a_bad_stream_id_is_refused(append: Append, stream: Any) -> None:
    with pytest.raises(errors.ValidationError, match="stream id") as info:
        append(stream, [episode_started()])
    assert info.value.field == "stream_id"
