"""The rollout benchmark runs end to end at tiny sizes (numbers are not checked), and its
last line is the machine-readable RESULT line."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.conftest import PostgresServer

BENCH = Path(__file__).resolve().parents[2] / "bench" / "rollout.py"


def test_benchmark_runs_with_tiny_sizes(tiny_model_dir: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("bench_rollout", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    report = module.main(["--episodes", "4", "--max-tokens", "4", "--concurrency", "1,4",
                          "--repeats", "1", "--no-vllm", "--no-store",
                          "--data-dir", str(tiny_model_dir.parent)])
    engine = report["engines"]["transformers"]
    assert engine["sequential"]["episodes"] == 4 and engine["sequential"]["tokens"] > 0
    assert [row["in_flight"] for row in engine["concurrent"]] == [1, 4]
    assert engine["ceiling"]["tokens"] > 0 and "vllm" not in report["engines"]
    out = capsys.readouterr().out
    assert "--no-vllm given" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("RESULT concurrent_vs_sequential=")
    assert "concurrent_vs_engine=" in last and "recording_overhead=nan" in last
    with pytest.raises(SystemExit):
        module.main(["--episodes", "0"])
    with pytest.raises(SystemExit):
        module.main(["--concurrency", "1,x"])
    with pytest.raises(SystemExit):
        module.main(["--device", "tpu"])
    with pytest.raises(SystemExit):
        module.main(["--model", "qwen3-9000b"])


def test_benchmark_reports_what_recording_costs(tiny_model_dir: Path, pg_server: PostgresServer,
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """With the store, the overhead comes with the recording's CPU per event, in the writing
    thread and in the PostgreSQL processes serving the scratch database, and its share of
    all the CPU the in-memory run used."""
    monkeypatch.setenv("TRAJSTORE_TEST_DATABASE_URL", pg_server.admin_url)
    spec = importlib.util.spec_from_file_location("bench_rollout_store", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    report = module.main(["--episodes", "4", "--max-tokens", "4", "--concurrency", "4",
                          "--repeats", "2", "--no-vllm",
                          "--data-dir", str(tiny_model_dir.parent)])
    recording = report["engines"]["transformers"]["recording"]
    assert len(recording["store"]) == len(recording["memory"]) == 2
    for memory, stored in zip(recording["memory"], recording["store"], strict=True):
        assert memory["events"] > 0 and stored["events"] > 0
        assert stored["process_cpu_s"] > 0 and stored["writer_cpu_s"] > 0
    assert isinstance(recording["process_cpu_ms_per_event"], float)
    assert recording["writer_cpu_ms_per_event"] > 0
    low, high = recording["overhead_range"]
    assert low <= recording["overhead"] <= high
    share = recording["cpu_share"]  # on Linux with the server on this host (any size here:
    assert share is None or share > 0  # four episodes keep the machine busy for a moment)
    assert recording["loop_cpu_ms_per_event"] > 0
    server = recording["server_cpu_ms_per_event"]
    assert server is None or server >= 0
    out = capsys.readouterr().out
    assert "recording CPU" in out and "ms/event in PostgreSQL" in out
    assert out.strip().splitlines()[-1].startswith("RESULT ")

    capsys.readouterr()
    only = module.main(["--episodes", "4", "--max-tokens", "4", "--concurrency", "1,4",
                        "--repeats", "1", "--no-vllm", "--recording-only", "--eager",
                        "--data-dir", str(tiny_model_dir.parent)])["engines"]["transformers"]
    assert "sequential" not in only and "ceiling" not in only
    assert [row["in_flight"] for row in only["concurrent"]] == [4]
    eager = only["recording"]["compared"]  # transactions written as soon as the last is done
    assert eager["interval_ms"] == 0
    assert len(eager["store"]) == 1 and eager["store"][0]["events"] > 0
    assert len(only["recording"]["store"]) == 1
    out = capsys.readouterr().out
    assert "   0 ms spacing" in out
    last = out.strip().splitlines()[-1]
    assert "concurrent_vs_sequential=nan" in last and "recording_overhead=nan" not in last
    with pytest.raises(SystemExit):
        module.main(["--recording-only", "--no-store"])
    for bad in (["--compare-interval", "1001"], ["--eager", "--compare-interval", "50"],
                ["--compare-interval", "50", "--no-store"]):
        with pytest.raises(SystemExit):
            module.main(bad)
