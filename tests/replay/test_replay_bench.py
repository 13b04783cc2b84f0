"""The merge and replay benchmarks run at a tiny size; the merge's two implementations agree."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

# Scratch databases on the session's server, not the user's default data directory.
pytestmark = pytest.mark.usefixtures("bench_database")

BENCH = Path(__file__).resolve().parents[2] / "bench" / "merge.py"


def test_merge_benchmark_runs_and_agrees(capsys) -> None:
    spec = importlib.util.spec_from_file_location("bench_merge", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ratios = module.main(["--turns", "16", "--tokens", "4"])  # asserts identical outputs
    assert set(ratios) == {"text", "token"}
    out = capsys.readouterr().out
    assert "16 turns" in out and "ratio" in out
    timelines = module.build_episode(16, 4)
    assert len(timelines) == 16 + 2 * 2  # one per turn, plus a failed call and a retry twice


def test_replay_benchmark_runs_at_a_tiny_size(capsys) -> None:
    """The replay benchmark projects its episodes (it asserts every one completes) with
    longer messages too, in one process and on a pool of two, and prints a ratio per
    round."""
    spec = importlib.util.spec_from_file_location("bench_replay", BENCH.with_name("replay.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ratios = module.main(["--episodes", "3", "--turns", "2", "--rounds", "1",
                          "--tool-tokens", "30", "--reply-tokens", "10"])
    assert len(ratios) == 1 and ratios[0] > 0
    out = capsys.readouterr().out
    assert "2 turns per round (tool outputs +30, replies +10 tokens)" in out
    assert "2 processes" in out  # (d): the same projection on a ProjectionPool
    assert out.splitlines()[-1].startswith("RESULT replay_vs_read=")
