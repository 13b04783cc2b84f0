"""Projecting on several processes (``ProjectionPool``, what ``trajstore replay --jobs``
uses) writes the rows that projecting in one process writes."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time
import uuid

import pytest
from test_replay_project_batch import new_run, record, renamed, rows
from test_replay_reuse import tool_episode

from store.eventlog import NO_STREAM, EventStore
from workers.replay.jobs.parallel import ProjectionPool
from workers.replay.jobs.project import project_episodes


@pytest.mark.timeout(240)
def test_a_pool_writes_what_one_process_writes(store: EventStore, qwen3, pg_url: str) -> None:
    run_id = new_run(store)
    pooled = record(store, qwen3, run_id, 6, prefix="pooled")
    alone = record(store, qwen3, run_id, 6, prefix="alone")
    unfinished = f"open-{uuid.uuid4().hex[:6]}"
    store.append(unfinished, tool_episode(qwen3, turns=1, reasoning=False)[:-2], NO_STREAM)
    missing = f"missing-{uuid.uuid4().hex[:6]}"
    with ProjectionPool(pg_url, jobs=2) as pool:
        outcomes = pool.project([*pooled, unfinished, missing])
        # Outcomes come back in the order asked, whichever process projected them.
        assert [o.episode_id for o in outcomes] == [*pooled, unfinished, missing]
        assert [o.outcome for o in outcomes] == ["written"] * 6 + ["unfinished", "missing"]
        assert [o.status for o in outcomes[:6]] == ["completed", "invalid", "completed",
                                                    "completed", "completed", "completed"]
        assert [o.outcome for o in pool.project(pooled)] == ["skipped"] * 6
        assert pool.project([]) == []
    project_episodes(store, alone)

    got = rows(store, pooled)
    assert got["samples"] and got["failures"]
    assert renamed(got, pooled) == renamed(rows(store, alone), alone)


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "2"])
@pytest.mark.parametrize("name", ["jobs", "batch"])
def test_a_pool_refuses_a_bad_number_of_jobs_or_batch(name: str, value, pg_url: str) -> None:
    options = {"jobs": 1, name: value}
    with pytest.raises(ValueError, match=f"{name} must be a positive int"):
        ProjectionPool(pg_url, **options)


def test_a_pool_refuses_an_empty_url_and_ids_that_are_not_strings(pg_url: str) -> None:
    with pytest.raises(ValueError, match="database_url"):
        ProjectionPool("", jobs=1)
    with ProjectionPool(pg_url, jobs=1) as pool:
        for bad in ("episode-1", [1, 2], None):
            with pytest.raises(TypeError, match="episode_ids must be a list of strings"):
                pool.project(bad)  # type: ignore[arg-type]


@pytest.mark.timeout(120)
def test_a_pool_that_cannot_connect_raises_instead_of_hanging(pg_url: str) -> None:
    unreachable = pg_url.rsplit("/", 1)[0] + f"/no_such_database_{uuid.uuid4().hex[:8]}"
    with ProjectionPool(unreachable, jobs=1) as pool:
        with pytest.raises(concurrent.futures.process.BrokenProcessPool):
            pool.project(["episode-1"])


@pytest.mark.timeout(240)
def test_a_killed_pool_process_leaves_whole_episodes_and_a_second_pass_finishes(
        store: EventStore, qwen3, pg_url: str) -> None:
    """SIGKILL a pool process while it projects: the pool reports it broken, each episode is
    either fully projected or not at all, and projecting the same ids again writes the rest,
    with the rows one process writes."""
    run_id = new_run(store)
    pooled = record(store, qwen3, run_id, 24, prefix="killed")
    alone = record(store, qwen3, run_id, 24, prefix="alive")
    warm = record(store, qwen3, run_id, 1, prefix="warm")
    with ProjectionPool(pg_url, jobs=1, batch=3) as pool:
        pool.project(warm)  # the process has started and loaded the tokenizer
        (process,) = pool._executor._processes.values()  # type: ignore[attr-defined]

        def kill_once_a_transaction_committed() -> None:
            # Eight transactions of three episodes: the kill lands among them.
            with store.db.connection() as conn:
                while conn.execute("SELECT count(*) FROM episodes WHERE episode_id ="
                                   " ANY(%s)", (pooled,)).fetchone()[0] < 3:
                    time.sleep(0.001)
            os.kill(process.pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_once_a_transaction_committed)
        killer.start()
        with pytest.raises(concurrent.futures.process.BrokenProcessPool):
            pool.project(pooled)
        killer.join()
    half = rows(store, pooled)
    projected = {r[0] for r in half["episodes"]}
    assert len(projected) % 3 == 0  # whole transactions of three
    for table, found in half.items():  # nothing of an episode without its summary row
        assert {r[0] for r in found} <= projected, table
    with ProjectionPool(pg_url, jobs=2) as pool:
        outcomes = pool.project(pooled)
    assert [o.outcome for o in outcomes] == ["skipped" if e in projected else "written"
                                             for e in pooled]
    project_episodes(store, alone)
    assert renamed(rows(store, pooled), pooled) == renamed(rows(store, alone), alone)
