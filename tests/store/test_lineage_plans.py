"""Lineage stays an index walk at a million rows: ``step_samples`` seeded with 1M rows
(``generate_series``, ``bench/lineage.py``'s seed) and EXPLAIN shows "what fed step k of run
R" and "which steps trained episode e" reading through their indexes, never a sequential
scan; both answer the seeded rows. The benchmark itself runs at a tiny size and ends with
its RESULT line (no timing is asserted)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from store import migrate
from store.db import Database
from store.lineage import episode_lineage, step_lineage
from tests.conftest import PostgresServer

BENCH = Path(__file__).resolve().parents[2] / "bench" / "lineage.py"
INDEX_SCANS = {"Index Scan", "Index Only Scan", "Bitmap Index Scan"}


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_lineage", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def million(pg_server: PostgresServer) -> Iterator[str]:
    url = pg_server.create_database("trajstore_lineage")
    migrate.upgrade(url)
    # 100 runs x 1000 steps x 10 samples; each episode trained by 2 steps of its run.
    assert _bench().seed(url, runs=100, steps=1000, batch=10, epochs=2) == 1_000_000
    yield url
    pg_server.drop_database(url)


def _index_scans(nodes: list[dict[str, Any]]) -> set[str]:
    assert not [n for n in nodes if n["Node Type"] == "Seq Scan"], nodes
    return {n["Index Name"] for n in nodes if n["Node Type"] in INDEX_SCANS}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_both_lineage_queries_are_index_scans_on_a_million_rows(million: str) -> None:
    plans = _bench().plans(million, "run-42", 731, "ep-42-230-3")
    assert _index_scans(plans["step"]) == {"step_samples_step_idx"}
    assert _index_scans(plans["episode"]) == {"step_samples_episode_idx"}
    db = Database(million, max_size=1)
    try:
        (fed,) = step_lineage(db, "run-42", 731)
        assert [s.position for s in fed.samples] == list(range(10))
        assert fed.policy_version == 731 and fed.dataset_id is None
        # Step 731 is the second pass over the episodes of step 231 (500 steps a pass).
        assert fed.episode_ids == tuple(f"ep-42-230-{i}" for i in range(5))
        steps = episode_lineage(db, "ep-42-230-3")
        assert [(s.run_id, s.step, len(s.sample_ids)) for s in steps] == [
            ("run-42", 231, 2), ("run-42", 731, 2)]
    finally:
        db.close()


def test_the_benchmark_runs_at_a_tiny_size(capsys: pytest.CaptureFixture[str]) -> None:
    result = _bench().main(["--runs", "2", "--steps", "20", "--batch", "4", "--queries", "5"])
    assert result["rows"] == 160
    out = capsys.readouterr().out
    # (160 rows are read sequentially: the plans are asserted at a million above.)
    assert "step query plan: " in out and "episode query plan: " in out
    last = out.splitlines()[-1]
    assert last.startswith("RESULT step_query_ms=") and " episode_query_ms=" in last
