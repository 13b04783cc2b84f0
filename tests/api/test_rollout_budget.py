"""Per-project rollout budgets on the shared rollout workers (``workers.rollout.fair``): one
project's many slow remote rollouts hold at most ``rollout_project_running`` worker slots,
the rest wait parked off the slots, and another project's rollout is played meanwhile; one
more than ``rollout_project_queued`` is refused 429 naming the setting, and nothing of it is
queued. Real API, a real ``trajstore worker --queues rollout`` process (two slots), the
session's PostgreSQL and a Redis of the module's own."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from starlette.responses import Response

from api.app import create_app
from store.eventlog import EventStore
from store.settings import Settings
from tests.api.conftest import Project
from tests.api.test_remote_async_init import init_body, new_run
from tests.rollout.chat_trainer import ChatTrainer
from tests.workers.conftest import Worker
from workers.rollout import fair

pytestmark = pytest.mark.timeout(600)

QUEUED = 5


class GatedTrainer(ChatTrainer):
    """A trainer that holds every generation of a rollout id starting with ``slow-`` until
    ``gate`` is set: the attacker's slow trainer."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.held = 0

    def _answer(self, path: str, body: dict[str, Any]) -> Response:
        if str(body.get("rollout_id", "")).startswith("slow-"):
            with self.lock:
                self.held += 1
            self.gate.wait(300)
        return super()._answer(path, body)


@pytest.fixture(scope="module")
def trainer(tiny_model_dir: Path) -> Iterator[GatedTrainer]:
    from workers.engines.backend_transformers import TransformersBackend

    server = GatedTrainer(TransformersBackend(tiny_model_dir))
    with server:
        yield server
        server.gate.set()


@pytest.fixture(scope="module")
def budget_worker(pg_url: str, rollout_broker: str, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[Worker]:
    """Two rollout slots; one project may run one rollout at a time."""
    directory = tmp_path_factory.mktemp("budget-worker")
    worker = Worker(Settings(database_url=pg_url, redis_url=rollout_broker, data_dir=directory),
                    ["--queues", "rollout", "--concurrency", "2"], directory / "worker.log",
                    TRAJSTORE_ROLLOUT_PROJECT_RUNNING="1")
    try:
        worker.wait_ready()
        yield worker
    finally:
        worker.stop()


@pytest.fixture
def api_settings(tmp_path: Path, pg_url: str, rollout_broker: str) -> Settings:
    return Settings(database_url=pg_url, redis_url=rollout_broker, data_dir=tmp_path,
                    api_key_scrypt_n=1024, rollout_project_running=1,
                    rollout_project_queued=QUEUED)


@pytest.fixture
def client(api_settings: Settings, api_store: EventStore, budget_worker: Worker
           ) -> Iterator[TestClient]:
    with TestClient(create_app(api_settings, store=api_store)) as c:
        yield c


def test_a_flood_of_slow_rollouts_leaves_the_neighbours_rollout_played(
        client: TestClient, project: Project, other_project: Project, api_store: EventStore,
        api_settings: Settings, trainer: GatedTrainer, tiny_model_dir: Path) -> None:
    attacker_run = new_run(client, project, str(tiny_model_dir))
    victim_run = new_run(client, other_project, str(tiny_model_dir))
    slow = []
    for _ in range(QUEUED):
        body = init_body(trainer.url, attacker_run, rollout_id=f"slow-{uuid.uuid4().hex[:8]}")
        trainer.script(body["rollout_id"], ["It is 8."])
        r = client.post("/v1/rollout/init", headers=project.headers("ingest"), json=body)
        assert r.status_code == 202, r.text
        slow.append(body["rollout_id"])

    # one more than the project's queue: 429 naming the setting, and not queued
    extra = init_body(trainer.url, attacker_run, rollout_id=f"slow-{uuid.uuid4().hex[:8]}")
    r = client.post("/v1/rollout/init", headers=project.headers("ingest"), json=extra)
    assert r.status_code == 429, r.text
    assert "TRAJSTORE_ROLLOUT_PROJECT_QUEUED" in r.json()["error"]["message"]
    assert r.headers.get("retry-after")
    assert fair.in_use(api_settings, project.name)[0] == QUEUED

    # the neighbour's rollout is played while all the attacker's are held or parked
    body = init_body(trainer.url, victim_run)
    trainer.script(body["rollout_id"], ["It is 8."])
    r = client.post("/v1/rollout/init", headers=other_project.headers("ingest"), json=body)
    assert r.status_code == 202, r.text
    report = trainer.wait_completed(body["rollout_id"], timeout_s=120)
    assert report["status"] == "COMPLETED", report
    assert not trainer.gate.is_set()
    assert trainer.held == 1, "one project runs at most rollout_project_running rollouts"
    assert not any(b["rollout_id"] in slow for b in trainer.completed)
    assert fair.parked_count(api_settings, project.name) == QUEUED - 1
    assert api_store.stream_version(f"rollout-{extra['rollout_id']}") == 0

    # released, every parked rollout of the attacker is played in turn, and its places freed
    trainer.gate.set()
    for rid in slow:
        assert trainer.wait_completed(rid, timeout_s=180)["status"] == "COMPLETED"
    assert fair.parked_count(api_settings, project.name) == 0
    # the last task gives its places back right after its report
    deadline = time.monotonic() + 30
    while fair.in_use(api_settings, project.name) != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert fair.in_use(api_settings, project.name) == (0, 0)
    # the refused one may be sent again now
    r = client.post("/v1/rollout/init", headers=project.headers("ingest"), json=extra)
    assert r.status_code == 202, r.text
