"""Gap-free reading in commit order with concurrent writer processes; subscriptions."""

from __future__ import annotations

import multiprocessing as mp
import random
import threading
import time
import uuid

import pytest

from store import errors
from store.db import Database
from store.eventlog import EventStore, LogPosition
from store.events import RewardAssigned, ToolReturned
from store.settings import Settings
from store.subscription import Listener, subscribe
from tests.factories import episode_started, trajectory

WRITERS = 4
BATCHES_PER_WRITER = 40


def _writer(url: str, writer: int, queue: mp.Queue) -> None:
    store = EventStore(Database(url, max_size=1), Settings(database_url=url))
    rng = random.Random(writer)
    ids: list[str] = []
    try:
        for b in range(BATCHES_PER_WRITER):
            stream = f"w{writer}-{b}-{uuid.uuid4().hex[:6]}"
            events = [episode_started(event_id=uuid.uuid4())]
            events += [
                ToolReturned(event_id=uuid.uuid4(), name="calc", output="x" * rng.randint(0, 4000))
                for _ in range(rng.randint(0, 4))
            ]
            if rng.random() < 0.3:
                events += trajectory(2, seed=rng.randint(0, 10**6))
            store.append(stream, events)
            ids += [str(e.event_id) for e in events]
    finally:
        store.close()
    queue.put(ids)


def test_concurrent_writers_reader_sees_every_event_once_in_stable_order(
    store: EventStore, pg_url: str
) -> None:
    start = _tail(store)
    ctx = mp.get_context("spawn")
    queue: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(pg_url, w, queue)) for w in range(WRITERS)]
    for p in procs:
        p.start()

    seen: list[str] = []
    naive_seen: set[str] = set()
    naive_last = _max_position(store)
    checkpoint = start
    deadline = time.monotonic() + 240
    written: list[str] = []
    while time.monotonic() < deadline:
        batch = store.read_all(checkpoint, limit=37)
        if batch:
            checkpoint = batch[-1].log_position
            seen += [str(r.event.event_id) for r in batch]
        # What a reader following "position > last seen" would get (for the report only).
        with store.db.connection() as conn:
            rows = conn.execute(
                "SELECT event_id, position FROM events WHERE position > %s ORDER BY position",
                (naive_last,),
            ).fetchall()
        for eid, pos in rows:
            naive_seen.add(str(eid))
            naive_last = max(naive_last, pos)
        if not any(p.is_alive() for p in procs) and not batch:
            break
    for _ in procs:
        written += queue.get(timeout=60)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    # One more read: anything written but not yet seen would show up here.
    while batch := store.read_all(checkpoint, limit=1000):
        checkpoint = batch[-1].log_position
        seen += [str(r.event.event_id) for r in batch]

    assert len(seen) == len(set(seen)), "an event was delivered twice"
    assert set(seen) == set(written), f"{len(set(written) - set(seen))} events never delivered"
    again = [str(r.event.event_id) for r in _read_everything(store, start)]
    assert again == seen, "a second read gave another order"
    missed = len(set(written) - naive_seen)
    print(f"\nreader saw {len(seen)} of {len(written)}; a position>last reader missed {missed}")


def _tail(store: EventStore) -> LogPosition:
    position = LogPosition(0, 0)
    while batch := store.read_all(position, limit=5000):
        position = batch[-1].log_position
    return position


def _read_everything(store: EventStore, start: LogPosition) -> list:
    out, position = [], start
    while batch := store.read_all(position, limit=500):
        out += batch
        position = batch[-1].log_position
    return out


def _max_position(store: EventStore) -> int:
    with store.db.connection() as conn:
        return conn.execute("SELECT coalesce(max(position), 0) FROM events").fetchone()[0]


def test_reader_waits_for_a_transaction_that_commits_late(store: EventStore, pg_url: str) -> None:
    """A row inserted first but committed last is not skipped: the reader holds back until the
    slow transaction ends, then delivers it before anything after it."""
    start = _tail(store)
    import psycopg

    slow = psycopg.connect(pg_url)
    slow.execute("SELECT pg_current_xact_id()")  # takes a transaction id now
    store.append(f"ep-{uuid.uuid4().hex}", [episode_started()])  # commits first
    assert store.read_all(start) == [], "rows behind a running transaction must wait"
    slow.execute(
        "INSERT INTO events (event_id, stream_id, stream_version, type, schema_version, data)"
        " VALUES (%s, %s, 1, 'reward_assigned', 1, %s)",
        (uuid.uuid4(), f"late-{uuid.uuid4().hex}", '{"value": 0.5}'),
    )
    slow.commit()
    slow.close()
    batch = store.read_all(start)
    assert [r.type for r in batch] == ["reward_assigned", "episode_started"]


def test_type_filter(store: EventStore) -> None:
    start = _tail(store)
    store.append(f"ep-{uuid.uuid4().hex}", [episode_started(), RewardAssigned(value=0.25)])
    got = store.read_all(start, types=["reward_assigned"])
    assert [r.event.value for r in got] == [0.25]


def test_delta_event_read_alone_decodes_its_chain(store: EventStore) -> None:
    stream = f"ep-{uuid.uuid4().hex}"
    calls = trajectory(5, seed=3)
    store.append(stream, [episode_started()])
    for c in calls:
        store.append(stream, [c])
    start = _tail(store)
    extra = trajectory(6, seed=3)[5]
    store.append(stream, [extra])
    (only,) = store.read_all(start)
    assert only.event.prompt_ids.tolist() == extra.prompt_ids.tolist()
    assert only.event.messages == extra.messages


@pytest.mark.timeout(60)
def test_subscribe_wakes_on_append(store: EventStore) -> None:
    start = _tail(store)
    stop = threading.Event()
    got: list[str] = []

    # Append only once the reader has read the (empty) tail and waits on its listener:
    # appended earlier, the events would be read without any notification at all.
    waiting = threading.Event()
    woken: list[bool] = []

    def watched_listener(url: str) -> Listener:
        listener = Listener(url)
        wait = listener.wait

        def watched_wait(timeout: float) -> bool:
            waiting.set()
            woke = wait(timeout)
            woken.append(woke)
            return woke

        listener.wait = watched_wait  # type: ignore[method-assign]
        return listener

    def consume() -> None:
        for batch in subscribe(store, start, poll_interval=30, stop=stop,
                               listen=watched_listener):
            got.extend(r.type for r in batch)
            if "reward_assigned" in got:
                stop.set()

    t = threading.Thread(target=consume)
    t.start()
    assert waiting.wait(timeout=20), "the subscription never waited"
    store.append(f"ep-{uuid.uuid4().hex}", [episode_started(), RewardAssigned(value=1.0)])
    # The polling fallback is 30 s: finishing before then means NOTIFY woke the reader.
    t.join(timeout=20)
    assert not t.is_alive(), "the subscription did not wake"
    assert got == ["episode_started", "reward_assigned"]
    assert True in woken, "the events were read without a notification"


@pytest.mark.timeout(60)
def test_store_subscribe_follows_from_its_checkpoint(store: EventStore) -> None:
    """``EventStore.subscribe`` is the subscription on the store: batches of at most
    ``batch_size`` from the checkpoint on, in commit order, until ``stop`` is set."""
    start = _tail(store)
    stream = f"ep-{uuid.uuid4().hex}"
    store.append(stream, [episode_started(), RewardAssigned(value=0.5)])
    store.append(stream, [ToolReturned(name="calc", output="1")])
    stop = threading.Event()
    batches = []
    for batch in store.subscribe(start, batch_size=2, poll_interval=0.1, stop=stop):
        batches.append([r.type for r in batch])
        if sum(map(len, batches)) == 3:
            stop.set()
    assert batches == [["episode_started", "reward_assigned"], ["tool_returned"]]
    with pytest.raises(errors.ValidationError, match="limit"):
        next(store.subscribe(start, batch_size=0))


@pytest.mark.timeout(60)
def test_subscribe_reads_events_held_back_by_a_transaction_that_ends_without_appending(
        store: EventStore, pg_url: str) -> None:
    """An append commits (its notification arrives) while an older transaction is still
    running: ``read_all`` holds the event back until that transaction ends, and it ends
    (rolled back) without appending, so no notification follows. The subscription reads the
    event anyway, long before its 30 s polling fallback, because it reads again while events
    are held back."""
    import psycopg

    start = _tail(store)
    stop = threading.Event()
    got: list[str] = []

    def consume() -> None:
        for batch in subscribe(store, start, poll_interval=30, stop=stop):
            got.extend(r.type for r in batch)
            stop.set()

    with psycopg.connect(pg_url) as older:
        older.execute("SELECT pg_current_xact_id()")  # a transaction id: the reading line
        store.append(f"ep-{uuid.uuid4().hex}", [episode_started(), RewardAssigned(value=1.0)])
        assert store.read_all(start) == [] and store.held_back(start)
        t = threading.Thread(target=consume)
        t.start()
        try:
            time.sleep(0.5)  # the subscription has read nothing and waits
            assert got == []
            older.rollback()
            t.join(timeout=20)
            assert not t.is_alive(), "the held-back events were left to the 30 s poll"
        finally:
            stop.set()
            t.join(timeout=40)
    assert got == ["episode_started", "reward_assigned"]
    assert not store.held_back(start)
