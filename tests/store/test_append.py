"""Append: idempotency, optimistic concurrency, atomic batches, denormalised columns."""

from __future__ import annotations

import threading
import uuid

import psycopg
import pytest

from store import errors
from store.eventlog import ANY, NO_STREAM, EventStore, run_stream_id
from store.events import EpisodeFinished, LLMCalled, RewardAssigned, RunCreated
from store.rows import same_content
from tests.factories import closing, episode_started, trajectory


def _count(store: EventStore, stream: str) -> int:
    return len(store.read_stream(stream))


def new_stream() -> str:
    return f"ep-{uuid.uuid4().hex}"


def test_append_then_read_back_in_order(store: EventStore) -> None:
    stream = new_stream()
    events = [episode_started(), *trajectory(3), *closing()]
    result = store.append(stream, events, NO_STREAM)
    assert result.version == len(events)
    assert list(result.positions) == sorted(result.positions)
    back = store.read_stream(stream)
    assert [r.stream_version for r in back] == list(range(1, len(events) + 1))
    assert [r.type for r in back] == [e.type for e in events]
    assert [r.event.event_id for r in back][1:4] == [e.event_id for e in events[1:4]]
    assert same_content(back[-2].event, events[-2])
    assert all(same_content(r.event, e) for r, e in zip(back, events, strict=True))


def test_idempotent_retry_returns_original_positions_and_stores_nothing(store: EventStore) -> None:
    stream = new_stream()
    events = [e.model_copy(update={"event_id": uuid.uuid4()})
              for e in [episode_started(), *trajectory(2), *closing()]]
    first = store.append(stream, events, NO_STREAM)
    again = store.append(stream, events, NO_STREAM)  # stale version, but a pure retry
    assert again.duplicate and not first.duplicate
    assert again.positions == first.positions
    assert again.version == first.version
    assert _count(store, stream) == len(events)


def test_same_id_different_content_is_an_error(store: EventStore) -> None:
    stream = new_stream()
    eid = uuid.uuid4()
    store.append(stream, [episode_started(), RewardAssigned(event_id=eid, value=1.0)])
    with pytest.raises(errors.IdempotencyError, match=str(eid)):
        store.append(stream, [RewardAssigned(event_id=eid, value=0.0)])
    assert _count(store, stream) == 2


def test_retry_with_reordered_keys_is_still_a_retry(store: EventStore) -> None:
    stream = new_stream()
    call = trajectory(1)[0]
    store.append(stream, [episode_started(), call])
    reordered = LLMCalled.model_validate(
        {**{k: v for k, v in reversed(list(call.model_dump().items()))},
         "messages": [dict(reversed(list(m.items()))) for m in call.messages]}
    )
    assert reordered.event_id == call.event_id
    assert store.append(stream, [reordered]).duplicate
    # ...but a retry whose token ids differ is refused
    changed = call.model_copy(update={"response_ids": call.response_ids[::-1].copy()})
    with pytest.raises(errors.IdempotencyError):
        store.append(stream, [changed])
    assert store.stream_version(stream) == 2


def test_same_id_in_another_stream_is_an_error(store: EventStore) -> None:
    eid = uuid.uuid4()
    store.append(new_stream(), [episode_started(event_id=eid)])
    with pytest.raises(errors.IdempotencyError):
        store.append(new_stream(), [episode_started(event_id=eid)])


def test_batch_mixing_stored_and_new_ids_is_refused(store: EventStore) -> None:
    stream = new_stream()
    start = episode_started(event_id=uuid.uuid4())
    store.append(stream, [start])
    with pytest.raises(errors.ValidationError) as info:
        store.append(stream, [start, EpisodeFinished(status="completed")])
    assert info.value.event_index == 1
    assert _count(store, stream) == 1


def test_stale_expected_version_conflicts_and_stores_nothing(store: EventStore) -> None:
    stream = new_stream()
    store.append(stream, [episode_started()], NO_STREAM)
    store.append(stream, [RewardAssigned(value=1.0)], 1)
    with pytest.raises(errors.ConflictError) as info:
        store.append(stream, [EpisodeFinished(status="completed")], 1)
    assert info.value.actual == 2 and info.value.expected == 1
    with pytest.raises(errors.ConflictError):
        store.append(stream, [episode_started()], NO_STREAM)
    assert _count(store, stream) == 2
    store.append(stream, [EpisodeFinished(status="completed")], 2)
    assert store.stream_version(stream) == 3


def test_racing_appenders_with_one_expected_version_one_wins(store: EventStore) -> None:
    stream = new_stream()
    store.append(stream, [episode_started()], NO_STREAM)
    outcomes: list[str] = []
    barrier = threading.Barrier(4)

    def attempt(i: int) -> None:
        barrier.wait()
        try:
            store.append(stream, [RewardAssigned(value=float(i))], 1)
            outcomes.append("ok")
        except errors.ConflictError:
            outcomes.append("conflict")

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["conflict"] * 3 + ["ok"]
    assert store.stream_version(stream) == 2


def test_racing_appenders_with_any_all_land(store: EventStore) -> None:
    stream = new_stream()
    store.append(stream, [episode_started()], NO_STREAM)
    barrier = threading.Barrier(4)

    def attempt(i: int) -> None:
        barrier.wait()
        for _ in range(5):
            store.append(stream, [RewardAssigned(value=float(i))], ANY)

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.stream_version(stream) == 21
    assert [r.stream_version for r in store.read_stream(stream)] == list(range(1, 22))


def test_invalid_event_rejects_the_whole_batch(store: EventStore) -> None:
    stream = new_stream()
    good = trajectory(2)
    bad = {"type": "llm_called", "call_id": "x", "prompt_ids": [1, 2], "response_ids": [3, 4],
           "logprobs": [-0.1]}
    with pytest.raises(errors.ValidationError) as info:
        store.append(stream, [episode_started(), *good, bad])
    assert info.value.event_index == 3
    assert "equal length" in str(info.value)
    assert store.stream_version(stream) == 0


def test_run_and_group_are_denormalised_onto_episode_events(store: EventStore) -> None:
    stream = new_stream()
    store.append(stream, [episode_started(run_id="run-x", group_id="g7")])
    store.append(stream, [*trajectory(1), *closing()])
    rows = store.read_stream(stream)
    assert {(r.run_id, r.group_id) for r in rows} == {("run-x", "g7")}
    assert rows[1].agent == "main"


def test_run_lookups(store: EventStore) -> None:
    run = f"run-{uuid.uuid4().hex[:8]}"
    store.append(run_stream_id(run), [RunCreated(run_id=run)], NO_STREAM)
    assert store.get_run(run).run_id == run
    ep = new_stream()
    store.append(ep, [episode_started(run_id=run, group_id="g1"), *closing(0.5)])
    episodes = store.list_episodes(run)
    assert [(e.episode_id, e.status, e.reward) for e in episodes] == [(ep, "completed", 0.5)]
    assert store.get_episode(ep)[0].type == "episode_started"
    with pytest.raises(errors.NotFoundError):
        store.get_run("no-such-run")
    with pytest.raises(errors.NotFoundError):
        store.get_episode("no-such-episode")


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE events SET type = 'x' WHERE position = (SELECT min(position) FROM events)",
        "DELETE FROM events WHERE position = (SELECT min(position) FROM events)",
        "TRUNCATE events",
    ],
)
def test_events_are_immutable_whatever_the_client(store: EventStore, pg_url: str,
                                                   statement: str) -> None:
    store.append(new_stream(), [episode_started()])
    before = store.counts_by_type()
    with psycopg.connect(pg_url) as conn:  # a plain client, superuser, not the store API
        with pytest.raises(psycopg.Error, match="immutable"):
            conn.execute(statement)
    with pytest.raises(errors.RefusedError), store.db.transaction() as conn:
        conn.execute(statement)
    assert store.counts_by_type() == before


def test_key_order_survives_the_round_trip(store: EventStore) -> None:
    """Chat templates render dicts in key order, so replay needs the order that was sent."""
    stream = new_stream()
    tool = {"type": "function", "function": {"name": "search", "description": "d",
                                             "parameters": {"type": "object", "required": []}}}
    call = trajectory(1)[0].model_copy(update={"tools": [tool]})
    store.append(stream, [episode_started(tools=[tool]), call])
    back = store.read_stream(stream)
    assert list(back[1].event.tools[0]["function"]) == ["name", "description", "parameters"]
    assert list(back[0].event.tools[0]["function"]["parameters"]) == ["type", "required"]
