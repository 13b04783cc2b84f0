"""The derivation benchmark runs at a tiny size: one process and a pool of two derive the same
version, and it ends with its RESULT line."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

# Scratch databases on the session's server, not the user's default data directory.
pytestmark = pytest.mark.usefixtures("bench_database")

BENCH = Path(__file__).resolve().parents[2] / "bench" / "derive.py"


def test_derive_benchmark_runs_at_a_tiny_size(capsys) -> None:
    spec = importlib.util.spec_from_file_location("bench_derive", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # It asserts that both derivations give one content hash and keep every episode.
    ratios = module.main(["--episodes", "4", "--turns", "2", "--rounds", "1", "--last-turn"])
    assert set(ratios) == {"1p", "2p"} and all(r > 0 for r in ratios.values())
    out = capsys.readouterr().out
    assert "4 episodes x 2 turns per round (last turn only), fastest of 3" in out
    assert "derive, 2 processes" in out
    last = out.splitlines()[-1]
    assert last.startswith("RESULT derive_vs_read_1p=") and " derive_vs_read_2p=" in last
