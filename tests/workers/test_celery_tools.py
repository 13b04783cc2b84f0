"""Celery's own tools against real ``trajstore worker`` processes, run as docs/deploy.md says:
the ``celery`` command with the TRAJSTORE_* settings in its environment (``inspect ping``,
``inspect active_queues``, ``events --dump``, and Flower's API where Flower is installed).

Each tool is a separate ``celery -A workers.app ...`` process, so what is tested is that the
application finds the broker, its key prefix and the routes from the settings alone."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from store.settings import Settings
from tests.workers.conftest import _env, wait_for


def _celery(settings: Settings, *args: str, timeout: float = 60,
            **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "celery", "-A", "workers.app", *args],
                          env=_env(settings, **env), capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.timeout(300)
def test_inspect_ping_and_queues_answer_from_the_settings(
        worker_settings: Settings, start_worker) -> None:  # type: ignore[no-untyped-def]
    worker = start_worker("--queues", "replay")
    worker.wait_ready()
    ping = _celery(worker_settings, "inspect", "ping", "--json", "--timeout", "5")
    assert ping.returncode == 0, ping.stdout + ping.stderr
    replies = json.loads(ping.stdout.strip().splitlines()[-1])
    assert [name for name in replies if name.startswith("trajstore-replay@")], replies
    queues = _celery(worker_settings, "inspect", "active_queues", "--json", "--timeout", "5")
    assert queues.returncode == 0, queues.stdout + queues.stderr
    by_node = json.loads(queues.stdout.strip().splitlines()[-1])
    assert {q["name"] for qs in by_node.values() for q in qs} == {"replay"}


@pytest.mark.timeout(300)
def test_ping_with_another_key_prefix_reaches_no_worker(
        worker_settings: Settings, start_worker) -> None:  # type: ignore[no-untyped-def]
    """The key prefix is part of the address: a tool with another prefix sees no worker, so
    the passing test above is the settings at work, not any worker on the broker."""
    worker = start_worker("--queues", "replay")
    worker.wait_ready()
    ping = _celery(worker_settings, "inspect", "ping", "--timeout", "3",
                   TRAJSTORE_REDIS_KEY_PREFIX="someone-else:")
    assert ping.returncode != 0
    assert "No nodes replied" in ping.stdout + ping.stderr


@pytest.mark.timeout(300)
def test_events_dump_shows_a_task_sent_and_received(
        worker_settings: Settings, start_worker, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from workers.app import app, configure

    configure(app, worker_settings)
    worker = start_worker("--queues", "replay")
    worker.wait_ready()
    log = tmp_path / "events.log"
    with open(log, "wb") as out:
        dump = subprocess.Popen([sys.executable, "-m", "celery", "-A", "workers.app", "events",
                                 "--dump"], env=_env(worker_settings), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for(lambda: b"starting capture" in log.read_bytes(), timeout=60,
                     what="celery events to start")
            # The capture is subscribed once it has printed its first line; a task sent now
            # is seen from its send to its end.
            time.sleep(1)
            app.send_task("trajstore.replay_episode", args=["no-such-episode"])
            wait_for(lambda: b"task succeeded" in log.read_bytes()
                     or b"task failed" in log.read_bytes(), timeout=60,
                     what="the task's events")
        finally:
            dump.terminate()
            dump.wait(timeout=30)
    text = log.read_text(errors="replace")
    assert "task sent: trajstore.replay_episode" in text
    assert "task received: trajstore.replay_episode" in text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(300)
def test_flower_lists_the_workers(worker_settings: Settings, start_worker,  # type: ignore[no-untyped-def]
                                  tmp_path: Path) -> None:
    pytest.importorskip("flower", reason="Flower is not installed (pip install flower)")
    worker = start_worker("--queues", "replay")
    worker.wait_ready()
    port = _free_port()
    log = tmp_path / "flower.log"
    with open(log, "wb") as out:
        flower = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "workers.app", "flower", f"--port={port}",
             "--address=127.0.0.1"],
            env=_env(worker_settings, FLOWER_UNAUTHENTICATED_API="true"),
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            def workers() -> dict[str, object] | None:
                try:
                    with urllib.request.urlopen(
                            f"http://127.0.0.1:{port}/api/workers?refresh=1", timeout=10) as r:
                        return json.loads(r.read()) or None
                except OSError:
                    assert flower.poll() is None, log.read_text(errors="replace")[-3000:]
                    return None

            listed = wait_for(workers, timeout=90, what="Flower to list the worker")
        finally:
            flower.terminate()
            flower.wait(timeout=30)
    assert [name for name in listed if name.startswith("trajstore-replay@")], listed  # type: ignore[union-attr]
