"""The resume benchmark runs end to end at a reduced size (numbers are not checked, but
nothing may be lost), and its last line is the machine-readable RESULT line."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from tests.conftest import PostgresServer

BENCH = Path(__file__).resolve().parents[2] / "bench" / "resume.py"


@pytest.mark.timeout(900)
def test_resume_benchmark_runs_small(tiny_model_dir: Path, pg_server: PostgresServer,
                                     monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TRAJSTORE_TEST_DATABASE_URL", pg_server.admin_url)
    spec = importlib.util.spec_from_file_location("bench_resume", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    report = module.main(["--kills", "1", "--groups", "2", "--group-size", "2",
                          "--max-tokens", "16", "--data-dir", str(tiny_model_dir.parent)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    match = re.fullmatch(r"RESULT episodes_lost=(\d+) tool_duplicates=(\d+) "
                         r"regenerated_calls_per_inflight=(\S+) "
                         r"median_kill_to_next_event_s=(\S+)", last)
    assert match, last
    assert int(match.group(1)) == 0 == report["episodes_lost"]
    assert int(match.group(2)) == 0
    with pytest.raises(SystemExit):
        module.main(["--kills", "0"])
