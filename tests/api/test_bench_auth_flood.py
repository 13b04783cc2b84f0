"""bench/auth_flood.py runs end to end at tiny sizes (real server processes, both arms)."""

from __future__ import annotations

import pytest

from bench.auth_flood import main

# Scratch databases on the session's server, not the user's default data directory.
pytestmark = pytest.mark.usefixtures("bench_database")


@pytest.mark.timeout(300)
def test_auth_flood_bench_runs_at_tiny_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    results = main(["--seconds", "1", "--rate", "5"])
    for arm in ("off", "on"):
        r = results[arm]
        assert 0 < r["quiet_s"] and 0 < r["flood_s"] and r["ratio"] > 0
        assert r["flood_answers"]["failed"] == 0 and r["flood_answers"]["other"] == 0
    # Without protection no wrong secret is answered 429; with it, none is checked twice.
    assert results["off"]["flood_answers"]["429"] == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("RESULT flood_vs_quiet_off=") and "flood_vs_quiet_on=" in last
