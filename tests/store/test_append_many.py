"""Several streams' appends in one transaction (``append_many``) and the per-event-loop
batcher behind ``aappend``: each append keeps its own answer, a failing one leaves the others
stored, and concurrent coroutines share transactions."""

from __future__ import annotations

import asyncio
import uuid
from functools import partial

import pytest

from store import errors
from store.append_batcher import AppendBatcher
from store.eventlog import NO_STREAM, EventStore
from store.events import ToolReturned
from tests.factories import closing, episode_started, trajectory
from tests.store.test_append_contract import while_a_rival_commits


def new_stream() -> str:
    return f"ep-{uuid.uuid4().hex}"


def test_each_batch_answers_on_its_own(store: EventStore) -> None:
    fresh, later, finished, conflicting = (new_stream() for _ in range(4))
    store.append(later, [episode_started()], NO_STREAM)
    closed_at = store.append(finished, [episode_started(), *closing()], NO_STREAM).version
    store.append(conflicting, [episode_started(), *trajectory(1)], NO_STREAM)
    retried = [e.model_copy(update={"event_id": uuid.uuid4()})
               for e in (episode_started(), *trajectory(2))]
    duplicate = new_stream()
    first = store.append(duplicate, retried, NO_STREAM)

    answers = store.append_many([
        (fresh, [episode_started(), *trajectory(2)], NO_STREAM),
        (later, trajectory(1), 1),
        (finished, [ToolReturned(name="calculator", output="1")], closed_at),
        (conflicting, trajectory(1), 1),  # the stream is at 2
        ("", trajectory(1), NO_STREAM),  # a bad stream id
        (duplicate, retried, NO_STREAM),  # a faithful retry
    ])
    assert answers[0].version == 3 and answers[1].version == 2
    assert isinstance(answers[2], errors.ClosedError)
    assert isinstance(answers[3], errors.ConflictError) and answers[3].actual == 2
    assert isinstance(answers[4], errors.ValidationError)
    assert answers[5].duplicate and answers[5].positions == first.positions
    assert store.stream_version(fresh) == 3 and store.stream_version(later) == 2
    assert store.stream_version(finished) == closed_at
    assert store.stream_version(conflicting) == 2
    assert [r.type for r in store.read_stream(fresh)] == [
        "episode_started", "llm_called", "llm_called"]


def test_concurrent_coroutines_share_transactions(store: EventStore) -> None:
    streams = [new_stream() for _ in range(40)]
    batcher = AppendBatcher(store)

    async def episode(stream: str) -> list[int]:
        versions = []
        for batch, expected in (([episode_started()], NO_STREAM), (trajectory(1), 1),
                                (list(closing()), 2)):
            result = await batcher.append(stream, batch, expected)
            versions.append(result.version)
        return versions

    async def everything() -> list[list[int]]:
        return list(await asyncio.gather(*(episode(s) for s in streams)))

    assert asyncio.run(everything()) == [[1, 2, 5]] * len(streams)
    assert batcher.transactions < 3 * len(streams)
    assert batcher.cpu_seconds > 0  # the writing threads' CPU time in those transactions
    for stream in streams:
        assert [r.type for r in store.read_stream(stream)] == [
            "episode_started", "llm_called", "tool_returned", "reward_assigned",
            "episode_finished"]

    async def stale() -> None:
        await store.aappend(streams[0], trajectory(1), 1)

    with pytest.raises(errors.ClosedError):
        asyncio.run(stale())
    assert isinstance(store.append_batcher, AppendBatcher)  # the one aappend writes through
    assert store.append_batcher.transactions >= 1
    with pytest.raises(ValueError, match="max_batches"):
        AppendBatcher(store, max_batches=0)


def test_transactions_are_spaced_while_appends_keep_coming(store: EventStore) -> None:
    """With an interval, appends arriving while transactions keep being written wait for the
    next one together; an append after a quiet spell is written at once."""
    streams = [new_stream() for _ in range(20)]
    batcher = AppendBatcher(store, interval_s=0.5)

    async def episode(index: int, stream: str) -> int:
        version = 0
        for batch, expected in (([episode_started()], NO_STREAM), (trajectory(1), 1),
                                (list(closing()), 2)):
            await asyncio.sleep(0.01 * index)  # arrivals spread over 0.2 s
            version = (await batcher.append(stream, batch, expected)).version
        return version

    async def everything() -> list[int]:
        return list(await asyncio.gather(*(episode(i, s) for i, s in enumerate(streams))))

    assert asyncio.run(everything()) == [5] * len(streams)
    # 60 appends arriving one by one over 0.2 s per round: the first alone, then about one
    # transaction per round of batches (eagerly written, about one each).
    assert batcher.transactions <= 6
    for stream in streams:
        assert store.stream_version(stream) == 5

    idle = AppendBatcher(store, interval_s=30)

    async def alone() -> int:
        return (await asyncio.wait_for(idle.append(new_stream(), [episode_started()],
                                                   NO_STREAM), timeout=10)).version

    assert asyncio.run(alone()) == 1  # not held for the interval
    for bad in (-0.1, 61, float("nan"), "1", True):
        with pytest.raises(ValueError, match="interval_s"):
            AppendBatcher(store, interval_s=bad)  # type: ignore[arg-type]


def test_batches_met_twice_go_after_the_others(store: EventStore) -> None:
    """A stream's second batch, and ids that a batch before carries, are decided against
    what the batches before them wrote, as if appended one after the other."""
    twice, retried_stream, shared = new_stream(), new_stream(), new_stream()
    # Batches are written in the order of their streams (the order their locks are taken).
    shared_first, shared_second = f"{shared}-1", f"{shared}-2"
    stored = [episode_started(event_id=uuid.uuid4()), *trajectory(1)]
    store.append(retried_stream, stored, NO_STREAM)
    changed = [stored[0], stored[1].model_copy(update={"finish_reason": "length"})]
    calls = trajectory(2, seed=1)
    call = trajectory(1, seed=2)[0]
    answers = store.append_many([
        (twice, [episode_started(run_id="run-b", group_id="g7")], NO_STREAM),
        (twice, calls[:1], 1),
        (twice, calls[1:], 1),  # stale once the batch before it is stored
        (shared_second, [episode_started(), call], NO_STREAM),  # the same id as below
        (shared_first, [episode_started(), call], NO_STREAM),
        (retried_stream, changed, NO_STREAM),  # a retry that is not faithful
    ])
    assert [a.version for a in answers[:2]] == [1, 2]
    assert isinstance(answers[2], errors.ConflictError) and answers[2].actual == 2
    assert isinstance(answers[3], errors.IdempotencyError)
    assert answers[4].version == 2
    assert isinstance(answers[5], errors.IdempotencyError)
    assert store.stream_version(shared_second) == 0
    recorded = store.read_stream(twice)
    assert [r.type for r in recorded] == ["episode_started", "llm_called"]
    # The run and group of the stream's opening event are on every later row.
    assert {(r.run_id, r.group_id) for r in recorded} == {("run-b", "g7")}
    later = store.append_many([(twice, calls[1:], 2)])[0]
    assert later.version == 3
    assert store.read_stream(twice)[-1].run_id == "run-b"
    assert store.read_stream(twice)[-1].group_id == "g7"


def test_an_id_committed_meanwhile_undoes_the_shared_insert(store: EventStore,
                                                           pg_url: str) -> None:
    """An event id that another stream's writer commits while the batches are written
    fails their shared INSERT: nothing of it stays, and each batch runs again on its own."""
    racing, bystander = new_stream(), new_stream()
    batch = [episode_started(), *trajectory(1)]
    # The shared INSERT waits on the rival's uncommitted row with the same id.
    answers = while_a_rival_commits(pg_url, batch[1].event_id, partial(store.append_many, [
        (racing, batch, NO_STREAM),
        (bystander, [episode_started(), *trajectory(2)], NO_STREAM),
    ]))
    assert isinstance(answers[0], errors.IdempotencyError)
    assert store.stream_version(racing) == 0
    assert answers[1].version == 3 and store.stream_version(bystander) == 3


def test_append_interval_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    import pydantic

    from store.settings import Settings

    assert Settings().append_interval_ms == 100
    for bad in ("-1", "1001", "soon"):
        monkeypatch.setenv("TRAJSTORE_APPEND_INTERVAL_MS", bad)
        with pytest.raises(pydantic.ValidationError, match="append_interval_ms"):
            Settings()
    monkeypatch.setenv("TRAJSTORE_APPEND_INTERVAL_MS", "0")
    assert Settings().append_interval_ms == 0
