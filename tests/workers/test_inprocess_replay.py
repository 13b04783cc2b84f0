"""``trajstore serve``'s own replay (``workers.replay.jobs.inprocess``) on a real PostgreSQL
database of its own: the projects take turns on its one thread, a project's queue is bounded
and what it refuses is found by a pass, and the pass made on taking the lead finds what a
process that died had queued. (``tests/api/test_serve_replay.py`` runs it in a real
``trajstore serve``.)"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from store.db import Database
from store.eventlog import EventStore
from store.followers import ReplayDue, unprojected_page
from store.settings import Settings
from tests.replay.replay_tokenizers import qwen3_tokenizer
from tests.workers.conftest import wait_for
from tests.workers.test_replay_budget import episode, projected_at, record, samples_per_episode
from tests.workers.test_replay_dispatch import project_run
from workers.replay.jobs.inprocess import InProcessReplay


@pytest.fixture(scope="module")
def qwen3() -> Any:
    return qwen3_tokenizer()


@pytest.fixture
def store(migrated_db: str, tmp_path: Path) -> Iterator[EventStore]:
    s = EventStore(Database(migrated_db, max_size=4),
                   Settings(database_url=migrated_db, data_dir=tmp_path))
    yield s
    s.close()


def due(store: EventStore, episode_id: str, project: str) -> ReplayDue:
    return ReplayDue(episode_id, store.stream_version(episode_id), project)


def replay_on(store: EventStore, **kwargs: Any) -> InProcessReplay:
    """An in-process replay whose thread opens (and closes) a store of its own."""
    return InProcessReplay(lambda: EventStore(Database(store.db.url, max_size=2),
                                              store.settings), **kwargs)


def test_the_projects_take_turns_on_the_one_thread(store: EventStore, qwen3: Any) -> None:
    flood_run, neighbour_run = project_run(store, "flood"), project_run(store, "neighbour")
    flood = [record(store, episode(qwen3, flood_run, i), f"f{i}") for i in range(3)]
    neighbour = record(store, episode(qwen3, neighbour_run, 100), "n")
    replay = replay_on(store, cap=10)
    for e in flood:
        assert replay.offer(due(store, e, "flood"))
    assert replay.offer(due(store, neighbour, "neighbour"))
    assert replay.offer(due(store, flood[1], "flood"))  # queued once
    assert replay.queued() == {"flood": 3, "neighbour": 1}
    replay.start()
    try:
        wait_for(lambda: len(projected_at(store, [*flood, neighbour])) == 4,
                 what="the four replays")
    finally:
        replay.stop(timeout=60)
    at = projected_at(store, [*flood, neighbour])
    # One replay of each project in turn: the neighbour's after the flood's first only.
    assert sorted(at, key=at.__getitem__) == [flood[0], neighbour, flood[1], flood[2]]
    assert samples_per_episode(store, [*flood, neighbour]) == dict.fromkeys(
        [*flood, neighbour], 1)


def test_past_the_cap_an_episode_is_refused_and_a_pass_finds_it(store: EventStore,
                                                                  qwen3: Any) -> None:
    run_id = project_run(store, "flood")
    flood = [record(store, episode(qwen3, run_id, i), f"c{i}") for i in range(5)]
    replay = replay_on(store, cap=2)
    assert [replay.offer(due(store, e, "flood")) for e in flood] == [True, True, False,
                                                                     False, False]
    assert replay.queued() == {"flood": 2}
    replay.start()
    try:
        # The two queued are projected, the queue drains, a pass offers the other three.
        wait_for(lambda: len(projected_at(store, flood)) == 5, what="the refused replays")
    finally:
        replay.stop(timeout=60)
    assert samples_per_episode(store, flood) == dict.fromkeys(flood, 1)
    assert unprojected_page(store)[0] == []


def test_taking_the_lead_finds_what_was_never_projected(store: EventStore,
                                                        qwen3: Any) -> None:
    """Episodes a process that died had queued (finished, unprojected, behind the saved
    position of the follower): the next leader's pass projects them."""
    mine, theirs = project_run(store, "mine"), project_run(store, "theirs")
    lost = [record(store, episode(qwen3, mine, 0), "l0"),
            record(store, episode(qwen3, theirs, 1), "l1")]
    replay = replay_on(store, cap=5).start()
    try:
        replay.leading()
        wait_for(lambda: len(projected_at(store, lost)) == 2, what="the lost replays")
    finally:
        replay.stop(timeout=60)
    assert samples_per_episode(store, lost) == dict.fromkeys(lost, 1)


def test_pages_of_unprojected_episodes_read_each_once(store: EventStore, qwen3: Any) -> None:
    run_id = project_run(store, "p")
    episodes = [record(store, episode(qwen3, run_id, i), f"p{i}") for i in range(5)]
    seen: list[str] = []
    after: int | None = None
    pages = 0
    while True:
        page, after = unprojected_page(store, 2, after=after)
        seen += [d.episode_id for d in page]
        pages += 1
        if after is None:
            break
    assert seen == episodes and pages == 3
    assert {d.project for d in unprojected_page(store, 10)[0]} == {"p"}
    with pytest.raises(ValueError, match="at least one"):
        unprojected_page(store, 0)


def test_a_cap_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="cap=0"):
        InProcessReplay(lambda: None, cap=0)  # type: ignore[arg-type, return-value]
    with pytest.raises(ValueError, match="retry_s"):
        InProcessReplay(lambda: None, cap=1, retry_s=-1)  # type: ignore[arg-type, return-value]


def test_a_replay_that_keeps_failing_is_tried_again_less_and_less_often(
        store: EventStore, qwen3: Any) -> None:
    """A replay that fails with an error that is not transient is looked for again after
    retry_s, then twice that, and so on (not every retry_s for good, each failure a logged
    traceback); once it replays, it is forgotten."""
    run = project_run(store, "failing")
    episode_id = record(store, episode(qwen3, run, 1), "fails")
    attempts = []
    broken = [True]

    def before_commit() -> None:
        attempts.append(1)
        if broken[0]:
            raise RuntimeError("a replay that fails every time")

    replay = replay_on(store, cap=10, retry_s=0.05, before_commit=before_commit)
    replay.start()
    try:
        assert replay.offer(due(store, episode_id, "failing"))
        wait_for(lambda: replay.failing().get(episode_id, 0) >= 4, timeout=60,
                 what="four failures")
        # Waits of 0.05, 0.1, 0.2, then 0.4 and 0.8 s: in the next second it fails once or
        # twice more (every 0.05 s, twenty times); the follower offering the same version
        # meanwhile is taken as queued, and changes nothing.
        failures = replay.failing()[episode_id]
        assert replay.offer(due(store, episode_id, "failing"))
        time.sleep(1.0)
        broken[0] = False
        wait_for(lambda: projected_at(store, [episode_id]), timeout=60, what="the replay")
        wait_for(lambda: replay.failing() == {}, timeout=10, what="the failure forgotten")
    finally:
        replay.stop(timeout=30)
    # The failures counted, at most two more in the second, one more before the fix took,
    # and the replay that wrote.
    assert len(attempts) <= failures + 4, (len(attempts), failures)
    assert samples_per_episode(store, [episode_id]) == {episode_id: 1}
