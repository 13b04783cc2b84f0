"""Several streams' appends in one transaction (``append_many``) and the per-event-loop
batcher behind ``aappend``: each append keeps its own answer, a failing one leaves the others
stored, and concurrent coroutines share transactions."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from store import errors
from store.append_batcher import AppendBatcher
from store.eventlog import NO_STREAM, EventStore
from store.events import ToolReturned
from tests.factories import closing, episode_started, trajectory


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
    for stream in streams:
        assert [r.type for r in store.read_stream(stream)] == [
            "episode_started", "llm_called", "tool_returned", "reward_assigned",
            "episode_finished"]

    async def stale() -> None:
        await store.aappend(streams[0], trajectory(1), 1)

    with pytest.raises(errors.ClosedError):
        asyncio.run(stale())
    with pytest.raises(ValueError, match="max_batches"):
        AppendBatcher(store, max_batches=0)
