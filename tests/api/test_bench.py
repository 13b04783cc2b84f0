"""bench/api.py runs end to end at tiny sizes (a real server process, both phases)."""

from __future__ import annotations

import pytest

from bench.api import episode_events, main, to_json

# Scratch databases on the session's server, not the user's default data directory.
pytestmark = pytest.mark.usefixtures("bench_database")


def test_episode_events_shape_and_bad_size() -> None:
    events = episode_events(run_id="r", group_id="g", n_events=9, prompt=4, response=2, seed=0)
    assert len(events) == 9 and events[0].type == "episode_started"
    assert events[-1].type == "episode_finished" and events[-2].type == "reward_assigned"
    body = to_json(events[1], encoding="base64")
    assert body["type"] == "llm_called" and isinstance(body["prompt_ids"], str)
    with pytest.raises(ValueError, match="n_events must be >= 5, got 4"):
        episode_events(run_id="r", group_id="g", n_events=4, prompt=1, response=1, seed=0)


def test_bench_runs_at_tiny_sizes() -> None:
    results = main(["--episodes", "2", "--rounds", "1", "--batch-events", "10",
                    "--events", "400", "--episode-events", "20", "--runs", "2",
                    "--queries", "16", "--clients", "4"])
    assert results["append_ratio"] > 0 and results["stored_events"] >= 400
    assert set(results["queries"]) == {"episode (events, no tokens)",
                                       "episode (events + base64 tokens)", "list 50 of a run",
                                       "list 50, status + reward filter"}
    for stats in results["queries"].values():
        assert 0 < stats["p50"] <= stats["p99"] and stats["failed"] == 0
