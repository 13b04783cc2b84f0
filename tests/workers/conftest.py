"""Fixtures for worker tests: a database of their own, the embedded Redis, real Celery worker
processes started with ``trajstore worker``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from store import embedded
from store.db import Database
from store.eventlog import EventStore
from store.settings import Settings


@pytest.fixture
def worker_db(migrated_db: str) -> str:
    return migrated_db


@pytest.fixture
def broker_url(tmp_path: Path) -> str:
    """An embedded Redis of this test's own (its socket in the test's directory)."""
    return embedded.redis_url(Settings(data_dir=tmp_path / "broker"))


@pytest.fixture
def worker_settings(tmp_path: Path, worker_db: str, broker_url: str) -> Settings:
    return Settings(database_url=worker_db, redis_url=broker_url, data_dir=tmp_path,
                    visibility_timeout_s=5, sweep_interval_s=1)


@pytest.fixture
def worker_store(worker_settings: Settings) -> Iterator[EventStore]:
    from workers.app import app, configure

    configure(app, worker_settings)
    store = EventStore(Database(worker_settings.database_url or "", max_size=4),
                       worker_settings)
    yield store
    store.close()


def _env(settings: Settings, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
    env.update({
        "TRAJSTORE_DATABASE_URL": settings.database_url or "",
        "TRAJSTORE_REDIS_URL": settings.redis_url or "",
        "TRAJSTORE_DATA_DIR": str(settings.data_dir),
        "TRAJSTORE_VISIBILITY_TIMEOUT_S": str(settings.visibility_timeout_s),
        "TRAJSTORE_SWEEP_INTERVAL_S": str(settings.sweep_interval_s),
    })
    env.update(extra)
    return env


class Worker:
    """A ``trajstore worker`` process in its own process group."""

    def __init__(self, settings: Settings, args: list[str], log: Path, **env: str) -> None:
        self.log_path = log
        self._log = open(log, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trajstore", "worker", *args],
            env=_env(settings, **env), stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if b" ready." in self.log_path.read_bytes():
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"worker exited: {self.log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        raise AssertionError(f"worker not ready: {self.log_path.read_text()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL the worker and every process it started."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()


@pytest.fixture
def start_worker(worker_settings: Settings, tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    workers: list[Worker] = []

    def start(*args: str, **env: str) -> Worker:
        w = Worker(worker_settings, list(args) or ["--queues", "replay"],
                   tmp_path / f"worker-{len(workers)}.log", **env)
        workers.append(w)
        return w

    yield start
    for w in workers:
        w.stop()


def wait_for(predicate: Callable[[], object], timeout: float = 120, what: str = "") -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what or predicate}")
