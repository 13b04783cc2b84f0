"""``trajstore up``: supervised workers, one log stream, clean stop, non-zero exit when a
child dies. Runs on the embedded default in a data directory of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest


def _start(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
    env["TRAJSTORE_DATA_DIR"] = str(tmp_path)
    log = tmp_path / "up.log"
    proc = subprocess.Popen([sys.executable, "-m", "trajstore", "up", "--no-api"], env=env,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    return proc, log


def _wait_ready(proc: subprocess.Popen, log: Path, names: list[str]) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if all(f"trajstore-{n}@" in text and "ready." in text for n in names) and all(
            any(line.startswith(f"{n:<7} |") and "ready." in line for line in text.splitlines())
            for n in names
        ):
            return
        assert proc.poll() is None, text[-3000:]
        time.sleep(0.5)
    raise AssertionError(log.read_text(errors="replace")[-3000:])


def _children(proc: subprocess.Popen) -> list[psutil.Process]:
    return psutil.Process(proc.pid).children(recursive=True)


@pytest.mark.timeout(400)
def test_ctrl_c_stops_every_child_and_exits_zero(tmp_path: Path) -> None:
    proc, log = _start(tmp_path)
    _wait_ready(proc, log, ["replay", "rollout", "train"])
    children = _children(proc)
    assert len(children) >= 3
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 0
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"children still running: {alive}"
    text = log.read_text(errors="replace")
    # One stream: every child's lines, each prefixed with its name.
    for name in ("replay", "rollout", "train"):
        assert any(line.startswith(f"{name:<7} |") for line in text.splitlines())


@pytest.mark.timeout(400)
def test_a_dead_child_stops_the_rest_and_up_exits_non_zero(tmp_path: Path) -> None:
    proc, log = _start(tmp_path)
    _wait_ready(proc, log, ["replay", "rollout", "train"])
    children = _children(proc)
    rollout = [p for p in children
               if "rollout" in " ".join(p.cmdline()) and p.ppid() == proc.pid]
    assert rollout, "no rollout worker found"
    os.killpg(rollout[0].pid, signal.SIGKILL)
    assert proc.wait(timeout=120) == 1
    assert "rollout | exited with status" in log.read_text(errors="replace")
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"children still running: {alive}"
