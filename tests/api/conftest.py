"""Fixtures of the API tests: the app on the session's PostgreSQL database, keys of two
projects, a real ``trajstore serve`` process for the gateway tests, a real rollout worker
for the remote-rollout routes, tiny models."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from api.app import create_app
from api.keys import KeyStore
from store import embedded
from store.db import Database
from store.eventlog import EventStore
from store.settings import Settings, get_settings
from tests.servers import ServerProcess, free_port
from tests.workers.conftest import Worker


@dataclass
class Project:
    """A project with one key of each role."""

    name: str
    ingest: str
    read: str
    admin: str
    train: str

    def headers(self, role: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {getattr(self, role)}"}


def make_project(keys: KeyStore, name: str | None = None) -> Project:
    name = name or f"proj-{uuid.uuid4().hex[:8]}"
    tokens = {role: keys.create(project=name, role=role).token
              for role in ("ingest", "read", "admin", "train")}
    return Project(name=name, **tokens)


@pytest.fixture
def api_settings(tmp_path: Path, pg_url: str, tmp_path_factory: pytest.TempPathFactory
                 ) -> Settings:
    # Small scrypt cost keeps key creation quick; the default cost has its own test. The
    # tests' tokenizer folders (tiny models) live under the session's temporary folder.
    return Settings(database_url=pg_url, data_dir=tmp_path, api_key_scrypt_n=1024,
                    api_max_request_bytes=2 * 1024 * 1024, api_page_size=50,
                    tokenizer_roots=str(tmp_path_factory.getbasetemp()))


@pytest.fixture
def api_store(api_settings: Settings, pg_url: str) -> Iterator[EventStore]:
    s = EventStore(Database(pg_url, max_size=8), api_settings)
    yield s
    s.close()


@pytest.fixture
def key_store(api_store: EventStore, api_settings: Settings) -> Iterator[KeyStore]:
    keys = KeyStore(api_store.db, api_settings)
    yield keys
    keys.close()


@pytest.fixture
def client(api_settings: Settings, api_store: EventStore) -> Iterator[TestClient]:
    with TestClient(create_app(api_settings, store=api_store)) as c:
        yield c


@pytest.fixture
def project(key_store: KeyStore) -> Project:
    return make_project(key_store)


@pytest.fixture
def other_project(key_store: KeyStore) -> Project:
    return make_project(key_store)


class Server(ServerProcess):
    """A ``trajstore serve`` process on ``settings``' database and data folder, with ``env``
    added, launched at once (:class:`tests.servers.ServerProcess`: its own process group on
    a free port); ``wait_ready()`` before use, ``stop()`` after."""

    def __init__(self, settings: Settings, log: Path, *, replay: bool = False,
                 **env: str) -> None:
        port = free_port()
        environ = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
        environ.update({
            "TRAJSTORE_DATABASE_URL": settings.database_url or "",
            "TRAJSTORE_DATA_DIR": str(settings.data_dir),
            "TRAJSTORE_API_KEY_SCRYPT_N": str(settings.api_key_scrypt_n),
            "TRAJSTORE_TOKENIZER_ROOTS": settings.tokenizer_roots,
            "TRAJSTORE_LOG_LEVEL": "WARNING",
        })
        environ.update(env)
        # The session's database holds every test's episodes: a server replays them only
        # when a test asks (replay=True), as its own copy of the replay follower.
        super().__init__([sys.executable, "-m", "trajstore", "serve", "--host", "127.0.0.1",
                          "--port", str(port), "--replay" if replay else "--no-replay"],
                         port=port, log=log, env=environ)
        self.launch()


def serve_tiny_engine(settings: Settings, tiny_model_dir: Path, log: Path) -> Iterator[Server]:
    """A started ``trajstore serve`` on ``settings`` with the tiny model as its gateway's
    engine (16 tokens a call at most), stopped when the generator is closed: the body of a
    module's shared server fixture (``yield from``)."""
    server = Server(settings, log, TRAJSTORE_GATEWAY_ENGINE_MODEL=str(tiny_model_dir),
                    TRAJSTORE_GATEWAY_MAX_TOKENS="16")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture
def start_server(api_settings: Settings, tmp_path: Path) -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def start(*, replay: bool = False, **env: str) -> Server:
        server = Server(api_settings, tmp_path / f"server-{len(servers)}.log", replay=replay,
                        **env)
        servers.append(server)
        server.wait_ready()
        return server

    yield start
    for s in servers:
        s.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from workers.engines.tinymodel import tiny_model_path

    return tiny_model_path(tmp_path_factory.mktemp("api-tiny-model"), seed=0)


@pytest.fixture(scope="module")
def rollout_broker(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The URL of an embedded Redis of the module's own: the broker of the remote-rollout
    routes and their worker."""
    return embedded.redis_url(Settings(data_dir=tmp_path_factory.mktemp("broker")))


@pytest.fixture(scope="module")
def rollout_worker(pg_url: str, rollout_broker: str, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[Worker]:
    """A real ``trajstore worker --queues rollout`` process on the session's database and the
    module's broker: it plays what ``POST /rollout`` and ``POST /v1/rollout/init`` queue."""
    directory = tmp_path_factory.mktemp("rollout-worker")
    worker = Worker(Settings(database_url=pg_url, redis_url=rollout_broker, data_dir=directory),
                    ["--queues", "rollout", "--concurrency", "2"], directory / "worker.log")
    try:
        worker.wait_ready()
        yield worker
    finally:
        worker.stop()


@pytest.fixture
def gateway(api_settings: Settings, api_store: EventStore, tiny_model_dir: Path
            ) -> Iterator[TestClient]:
    """The app in process with the tiny model as the gateway's in-process engine."""
    settings = api_settings.model_copy(update={"gateway_engine_model": str(tiny_model_dir),
                                               "gateway_max_tokens": 16})
    with TestClient(create_app(settings, store=api_store)) as c:
        yield c


@pytest.fixture
def cli(pg_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Any]:
    """``trajstore export`` in process (typer's runner) on the session's database."""
    from trajstore.cli import app

    monkeypatch.setenv("TRAJSTORE_DATABASE_URL", pg_url)
    monkeypatch.setenv("TRAJSTORE_DATA_DIR", str(tmp_path))
    get_settings.cache_clear()
    runner = CliRunner()

    def invoke(*args: str) -> Any:
        return runner.invoke(app, ["export", *args])

    yield invoke
    get_settings.cache_clear()
