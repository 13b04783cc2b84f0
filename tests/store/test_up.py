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


def _server_processes(data_dir: Path) -> list[psutil.Process]:
    """The embedded PostgreSQL and Redis of ``data_dir`` that are running."""
    from store import embedded
    from store.settings import Settings

    settings = Settings(data_dir=data_dir)
    pids = [embedded._postgres_pid(settings.embedded_pg_dir),
            embedded._redis_pid(settings.embedded_redis_path)]
    found = []
    for pid in pids:
        if pid is not None and psutil.pid_exists(pid):
            found.append(psutil.Process(pid))
    return found


@pytest.mark.timeout(400)
def test_sigkill_of_up_leaves_no_process_running(tmp_path: Path) -> None:
    """SIGKILL gives ``up`` no chance to clean up: its children die of their parent's death,
    and its watchdog stops their process groups and the embedded servers ``up`` started."""
    proc, log = _start(tmp_path)
    _wait_ready(proc, log, ["replay", "rollout", "train"])
    everything = _children(proc) + _server_processes(tmp_path)
    names = " ".join(" ".join(p.cmdline()) for p in everything)
    assert "postgres" in names and "redis" in names and "trajstore.watchdog" in names, names
    proc.kill()
    proc.wait(timeout=30)
    gone, alive = psutil.wait_procs(everything, timeout=120)
    assert not alive, f"still running after up was killed: {alive}"


@pytest.mark.timeout(400)
def test_stop_stops_every_process_of_the_data_directory(tmp_path: Path) -> None:
    """Processes started one by one, and the one that started the embedded servers killed:
    ``trajstore stop`` finds the others in the data directory, stops each with the processes
    it started, then the servers, and names everything it stopped."""
    from trajstore.processes import registered

    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
    env["TRAJSTORE_DATA_DIR"] = str(tmp_path)

    def worker(queues: str) -> subprocess.Popen:
        log = tmp_path / f"{queues}.log"
        proc = subprocess.Popen([sys.executable, "-m", "trajstore", "worker", "--queues",
                                 queues, "--concurrency", "2", "--pool", "prefork"], env=env,
                                stdout=open(log, "wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while b" ready." not in log.read_bytes():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        return proc

    owner = worker("replay")  # starts the embedded Redis, and PostgreSQL to follow the log
    deadline = time.monotonic() + 180
    while len(servers := _server_processes(tmp_path)) < 2:
        assert time.monotonic() < deadline, servers
        time.sleep(0.5)
    owner.kill()  # SIGKILL: the servers are left running with no owner
    owner.wait(timeout=30)
    train = worker("train")
    sweep = subprocess.Popen([sys.executable, "-m", "trajstore", "sweep"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while {e.command for e in registered(tmp_path)} != {"worker --queues train", "sweep"}:
        assert time.monotonic() < deadline, registered(tmp_path)
        time.sleep(0.5)
    everything = [psutil.Process(train.pid), *psutil.Process(train.pid).children(True),
                  psutil.Process(sweep.pid), *servers]
    assert len(everything) >= 6  # the worker, its two pool processes, the sweep, 2 servers
    done = subprocess.run([sys.executable, "-m", "trajstore", "stop"], env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    said = done.stdout
    assert f"stopped trajstore worker --queues train (pid {train.pid})" in said, said
    assert f"stopped trajstore sweep (pid {sweep.pid})" in said, said
    for server in servers:
        assert f"(pid {server.pid}" in said, said
    assert "stopped postgresql (pid" in said and "stopped redis (pid" in said, said
    gone, alive = psutil.wait_procs(everything, timeout=30)
    assert not alive, f"still running after trajstore stop: {alive}"
    again = subprocess.run([sys.executable, "-m", "trajstore", "stop"], env=env,
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "nothing of" in again.stdout, again.stdout
