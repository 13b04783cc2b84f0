"""bench/isolation.py runs end to end at a reduced size (a real server process, attacking
client processes, a real replay worker, a scratch database): the RESULT line parses, the
victim has no errors, every flood is refused (or, the hostile template's, accepted) and the
victim's episodes are replayed."""

from __future__ import annotations

import pytest

from bench.isolation import main

# Scratch databases on the session's server, not the user's default data directory.
pytestmark = pytest.mark.usefixtures("bench_database")


@pytest.mark.timeout(300)
def test_isolation_bench_runs_at_a_reduced_size(capsys: pytest.CaptureFixture[str]) -> None:
    result = main(["--rounds", "3", "--replay-burst", "5"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("RESULT ")
    fields = dict(part.split("=", 1) for part in last.removeprefix("RESULT ").split())
    assert set(fields) == {"victim_p99_ratio", "api_p99_ratio", "replay_p99_ratio",
                           "victim_errors", "refusals_413", "refusals_429", "refusals_422",
                           "refusals_other", "accepted", "attacker_nice", "api_workers",
                           "load_avg"}
    assert float(fields["victim_p99_ratio"]) > 0
    assert set(result["ratios"]) == {"ingest", "query", "read", "gateway", "replay"}
    assert int(fields["victim_errors"]) == 0 == result["errors"]
    assert int(fields["refusals_413"]) + int(fields["refusals_429"]) > 0
    assert int(fields["refusals_422"]) > 0  # the gateway's caps, tokenizer folders
    assert int(fields["accepted"]) > 0  # the hostile template's and the replay flood's episodes
    assert int(fields["refusals_other"]) == 0
