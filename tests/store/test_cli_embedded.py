"""The CLI on the embedded default and on a configured server, in real subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _run(args: list[str], env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trajstore", *args],
        env=env, capture_output=True, text=True, timeout=timeout,
    )


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
    env.update(extra)
    return env


@pytest.mark.timeout(400)
def test_embedded_default_starts_migrates_and_stops(tmp_path: Path) -> None:
    env = _env(TRAJSTORE_DATA_DIR=str(tmp_path))
    sample = _run(["example", "--seed", "3"], env)
    assert sample.returncode == 0, sample.stderr
    episode = sample.stdout.split("episode", 1)[1].split()[0]
    status = _run(["status"], env)
    assert status.returncode == 0, status.stderr
    assert "(embedded)" in status.stdout and str(tmp_path) in status.stdout
    assert "llm_called" in status.stdout
    shown = _run(["events", episode, "--json"], env)
    assert shown.returncode == 0, shown.stderr
    lines = [json.loads(line) for line in shown.stdout.splitlines()]
    assert [x["type"] for x in lines] == [
        "episode_started", "llm_called", "checkpoint_created", "tool_returned", "llm_called",
        "reward_assigned", "episode_finished",
    ]
    # The second call's prompt extends the first call's prompt + generation.
    first, second = lines[1]["event"], lines[4]["event"]
    assert second["prompt_ids"][: len(first["prompt_ids"])] == first["prompt_ids"]
    # The embedded server stops with the last process that used it.
    pid_file = tmp_path / "postgres" / "postmaster.pid"
    for _ in range(100):
        if not pid_file.exists():
            break
        time.sleep(0.1)
    assert not pid_file.exists(), "embedded PostgreSQL still running after the CLI exited"


def test_configured_server_never_starts_an_embedded_one(tmp_path: Path, pg_url: str) -> None:
    env = _env(TRAJSTORE_DATA_DIR=str(tmp_path), TRAJSTORE_DATABASE_URL=pg_url)
    status = _run(["status"], env)
    assert status.returncode == 0, status.stderr
    assert "(server)" in status.stdout
    assert not (tmp_path / "postgres").exists()


def test_unmigrated_server_is_refused_with_the_fix(tmp_path: Path, fresh_db: str) -> None:
    env = _env(TRAJSTORE_DATA_DIR=str(tmp_path), TRAJSTORE_DATABASE_URL=fresh_db)
    status = _run(["status"], env)
    assert status.returncode == 1
    assert "trajstore migrate" in status.stderr  # errors go to standard error
    assert _run(["migrate"], env).returncode == 0
    assert _run(["status"], env).returncode == 0


def test_bad_arguments_are_named(tmp_path: Path, pg_url: str) -> None:
    env = _env(TRAJSTORE_DATA_DIR=str(tmp_path), TRAJSTORE_DATABASE_URL=pg_url)
    bad = _run(["events", "--after", "nonsense"], env)
    assert bad.returncode == 2 and "--after" in bad.stderr
    missing = _run(["events", "no-such-stream"], env)
    assert missing.returncode == 1 and "no stream" in missing.stdout


def test_version_help_and_quiet_by_default(tmp_path: Path) -> None:
    env = _env(TRAJSTORE_DATA_DIR=str(tmp_path))
    version = _run(["--version"], env)
    assert version.returncode == 0 and version.stdout.startswith("trajstore "), version
    short_help = _run(["-h"], env)
    assert short_help.returncode == 0 and "Commands" in short_help.stdout, short_help
    quiet = _run(["status"], env)
    assert quiet.returncode == 0, quiet.stderr
    # No INFO lines of the libraries (a warning or an error would still show).
    assert "INFO alembic" not in quiet.stderr and "INFO pgserver" not in quiet.stderr, \
        quiet.stderr
    assert "schema revision" in quiet.stdout
    loud = _run(["-v", "status"], env)
    assert loud.returncode == 0, loud.stderr
    assert "INFO alembic" in loud.stderr or "INFO pgserver" in loud.stderr, loud.stderr


def _postgres_running(directory: Path) -> bool:
    try:
        pid = int((directory / "postmaster.pid").read_text().splitlines()[0])
        os.kill(pid, 0)
    except (OSError, ValueError, IndexError):
        return False
    return True


def test_stop_after_a_killed_process_and_no_server_kept_by_a_dead_pid(tmp_path: Path) -> None:
    env = _env(TRAJSTORE_DATA_DIR=str(tmp_path))
    # A process that starts both embedded servers and dies without cleaning up.
    killed = subprocess.run(
        [sys.executable, "-c",
         "import os\n"
         "from store import embedded\n"
         "from store.settings import get_settings\n"
         "s = get_settings()\n"
         "embedded.database_url(s); embedded.redis_url(s)\n"
         "os._exit(0)\n"],
        env=env, capture_output=True, text=True, timeout=120)
    assert killed.returncode == 0, killed.stderr
    assert _postgres_running(tmp_path / "postgres")
    stopped = _run(["stop"], env)
    assert stopped.returncode == 0, stopped.stderr
    assert "stopped postgresql" in stopped.stdout and "stopped redis" in stopped.stdout
    assert not _postgres_running(tmp_path / "postgres")
    again = _run(["stop"], env)
    assert again.returncode == 0 and "nothing of" in again.stdout, again
    # The dead process's handle no longer keeps the server up: the next command's exit
    # stops it.
    killed = subprocess.run(
        [sys.executable, "-c",
         "import os\n"
         "from store import embedded\n"
         "from store.settings import get_settings\n"
         "embedded.database_url(get_settings())\n"
         "os._exit(0)\n"],
        env=env, capture_output=True, text=True, timeout=120)
    assert killed.returncode == 0, killed.stderr
    status = _run(["status"], env)
    assert status.returncode == 0, status.stderr
    for _ in range(100):
        if not _postgres_running(tmp_path / "postgres"):
            break
        time.sleep(0.1)
    assert not _postgres_running(tmp_path / "postgres")


def test_unknown_run_is_an_error_not_an_empty_table(tmp_path: Path, pg_url: str) -> None:
    env = _env(TRAJSTORE_DATA_DIR=str(tmp_path), TRAJSTORE_DATABASE_URL=pg_url)
    shown = _run(["analytics", "failures", "--run", "no-such-run"], env)
    assert shown.returncode == 1
    assert "no run 'no-such-run'" in shown.stderr


@pytest.mark.timeout(300)
def test_sigterm_stops_what_the_command_started(tmp_path: Path) -> None:
    """SIGTERM ends a command through its cleanup, as Ctrl-C does: the embedded PostgreSQL it
    started stops with it (the default action used to leave it running)."""
    import signal

    env = _env(TRAJSTORE_DATA_DIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "trajstore", "events", "--follow"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    handles = tmp_path / "postgres" / ".handle_pids.json"
    try:
        deadline = time.monotonic() + 180
        while not (handles.exists() and str(proc.pid) in handles.read_text()):
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the embedded server did not start"
            time.sleep(0.2)
        time.sleep(5)  # past the server's start and the migrations: following the log
        assert _postgres_running(tmp_path / "postgres")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    for _ in range(100):
        if not _postgres_running(tmp_path / "postgres"):
            break
        time.sleep(0.1)
    assert not _postgres_running(tmp_path / "postgres")
