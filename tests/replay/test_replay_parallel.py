"""Projecting on several processes (``ProjectionPool``, what ``trajstore replay --jobs``
uses) writes the rows that projecting in one process writes."""

from __future__ import annotations

import concurrent.futures
import uuid

import pytest
from test_replay_project_batch import new_run, record, renamed, rows
from test_replay_reuse import tool_episode

from store.eventlog import NO_STREAM, EventStore
from workers.replay.parallel import ProjectionPool
from workers.replay.project import project_episodes


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


@pytest.mark.parametrize("jobs", [0, -1, True, 1.5, "2"])
def test_a_pool_refuses_a_bad_number_of_jobs(jobs, pg_url: str) -> None:
    with pytest.raises(ValueError, match="jobs must be a positive int"):
        ProjectionPool(pg_url, jobs=jobs)


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
