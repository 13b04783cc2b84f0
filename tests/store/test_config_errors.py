"""Every configuration error is one line naming the setting and what is wrong, with exit
status 2, and starts nothing; the traceback only with ``-v``. Real subprocesses of the
command line, real servers to be refused by."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from trajstore.processes import registered


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
    env["TRAJSTORE_DATA_DIR"] = str(tmp_path)
    env.update(extra)
    return env


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trajstore", *args], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A port on which nothing listens (bound, never listening, while the test runs)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield int(s.getsockname()[1])


def _one_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, result.stdout + result.stderr
    return lines[0]


@pytest.mark.parametrize("command", [["status"], ["migrate"], ["serve"], ["worker"], ["up"],
                                     ["keys", "list"], ["events"],
                                     ["analytics", "failures", "--run", "r"]])
def test_an_unreachable_database_is_one_line_naming_it(
        command: list[str], tmp_path: Path, closed_port: int) -> None:
    url = f"postgresql://someone:s3cret@127.0.0.1:{closed_port}/trajstore"
    result = _run(command, _env(tmp_path, TRAJSTORE_DATABASE_URL=url,
                                TRAJSTORE_REDIS_URL="redis://127.0.0.1:6379/15"))
    assert result.returncode == 2, result.stdout + result.stderr
    line = _one_line(result)
    assert line.startswith("error: setting TRAJSTORE_DATABASE_URL: cannot connect to"), line
    assert f"127.0.0.1:{closed_port}" in line and "s3cret" not in line, line
    assert registered(tmp_path) == []  # nothing started


@pytest.mark.parametrize(("name", "value", "says"), [
    ("TRAJSTORE_DATABASE_URL", "not-a-url", "not a PostgreSQL URL"),
    ("TRAJSTORE_DATABASE_URL", "postgresql://h:port/db", "not a PostgreSQL URL"),
    ("TRAJSTORE_REDIS_URL", "http://127.0.0.1:6379", "not a Redis URL"),
    ("TRAJSTORE_API_URL", "127.0.0.1:8600", "not an HTTP URL"),
    ("TRAJSTORE_GATEWAY_UPSTREAM_URL", "gpu-node:8000", "not an HTTP URL"),
    ("TRAJSTORE_LOG_LEVEL", "loud", "not a log level"),
    ("TRAJSTORE_API_PORT", "0", "greater than or equal to 1"),
    ("TRAJSTORE_ROLLOUT_BACKEND", "tpu", "'transformers' or 'vllm'"),
    ("TRAJSTORE_REPLAY_PROJECT_RUNNING", "0", "greater than or equal to 1"),
    ("TRAJSTORE_REPLAY_PROJECT_RUNNING", "all", "valid integer"),
])
def test_a_setting_that_cannot_be_read_is_one_line(name: str, value: str, says: str,
                                                   tmp_path: Path) -> None:
    result = _run(["status"], _env(tmp_path, **{name: value}))
    assert result.returncode == 2, result.stdout + result.stderr
    line = _one_line(result)
    assert line.startswith(f"error: setting {name}="), line
    assert says in line, line


def test_a_secret_in_a_bad_setting_is_not_shown(tmp_path: Path) -> None:
    result = _run(["status"], _env(tmp_path, TRAJSTORE_DATABASE_URL="mysql://u:hunter2@h/db"))
    assert result.returncode == 2
    line = _one_line(result)
    assert "hunter2" not in line and "mysql://u:***@h/db" in line, line


def test_an_unreachable_broker_is_one_line_naming_it(tmp_path: Path, closed_port: int,
                                                     pg_url: str) -> None:
    result = _run(["worker", "--queues", "replay"], _env(
        tmp_path, TRAJSTORE_DATABASE_URL=pg_url,
        TRAJSTORE_REDIS_URL=f"redis://127.0.0.1:{closed_port}/0"))
    assert result.returncode == 2, result.stdout + result.stderr
    line = _one_line(result)
    assert line.startswith("error: setting TRAJSTORE_REDIS_URL: no answer from"), line


def test_a_taken_port_is_one_line_naming_it(tmp_path: Path, pg_url: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _run(["serve", "--port", str(port)],
                      _env(tmp_path, TRAJSTORE_DATABASE_URL=pg_url))
    assert result.returncode == 2, result.stdout + result.stderr
    line = _one_line(result)
    assert line.startswith("error: setting --host/--port: cannot listen on 127.0.0.1:"), line


def test_verbose_shows_the_traceback(tmp_path: Path, closed_port: int) -> None:
    url = f"postgresql://someone@127.0.0.1:{closed_port}/trajstore"
    result = _run(["-v", "status"], _env(tmp_path, TRAJSTORE_DATABASE_URL=url))
    assert result.returncode != 0
    assert "Traceback (most recent call last)" in result.stderr
    assert "ConfigurationError: TRAJSTORE_DATABASE_URL: cannot connect" in result.stderr
