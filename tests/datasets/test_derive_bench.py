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
    # It asserts that every derivation gives one content hash and keeps every episode, and
    # which took the samples from the projection.
    for last_turn, path in ((["--last-turn"], "replay"), ([], "projection"),
                            (["--rescore"], "projection")):
        ratios = module.main(["--episodes", "4", "--turns", "2", "--rounds", "1",
                              "--repeat", "1", *last_turn])
        assert set(ratios) == {"1p", "2p", "replay_1p", "replay_2p"}
        assert all(r > 0 for r in ratios.values())
        out = capsys.readouterr().out
        shape = (" (last turn only)" if "--last-turn" in last_turn else
                 " (re-scored by a reward function)" if "--rescore" in last_turn else "")
        assert (f"4 episodes x 2 turns per round{shape}, "
                f"fastest of 1; median derive/read ({path})") in out
        assert "derive, 2 processes" in out
        last = out.splitlines()[-1]
        assert last.startswith("RESULT derive_vs_read_1p=") and " derive_vs_read_2p=" in last
        assert " replay_derive_vs_read_2p=" in last and f" path={path} " in last
        assert last.endswith(" rules=rescore" if "--rescore" in last_turn else " rules=recorded")
