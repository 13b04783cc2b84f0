"""The rollout benchmark runs end to end at tiny sizes (numbers are not checked)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "rollout.py"


def test_benchmark_runs_with_tiny_sizes(tiny_model_dir: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("bench_rollout", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    report = module.main(["--requests", "2", "--max-tokens", "4", "--episodes", "2",
                          "--no-vllm", "--data-dir", str(tiny_model_dir.parent)])
    sequential = report["transformers"]["sequential"]
    assert sequential["tokens"] == 8 and sequential["tokens_per_s"] > 0
    assert report["transformers"]["episodes"]["episodes"] == 2
    assert "vllm" not in report and "--no-vllm given" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        module.main(["--requests", "0"])
