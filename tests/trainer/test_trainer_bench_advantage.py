"""bench/advantage.py runs end to end at tiny sizes and its vectorised results agree with the
loops it times (no timing is asserted)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "advantage.py"


def test_quick_run_prints_every_measurement() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    diffs = [float(x) for x in re.findall(r"max abs diff ([0-9.e+-]+)", out)]
    assert len(diffs) == 4
    assert max(diffs) <= 1e-6
    assert out.count("MEASURED") == 3 and out.count("EXTRAPOLATED") >= 1
    assert re.search(r"chunked / naive peak above inputs: 1/\d+", out)
