"""No request holds an API worker thread for a rollout: 50 synchronous ``POST /rollout``
requests (more than the API's pool of 40 threads) wait for their answer in a real ``trajstore
serve`` process while no rollout worker takes them, and another project's ``GET /v1/runs``
is still answered; one more rollout of the same project is over the per-project cap
(``TRAJSTORE_ROLLOUT_WAITING_PER_PROJECT``) and answered 429 naming it, while another
project may still start one."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from store.settings import Settings
from tests.api.conftest import Project, Server
from workers.rollout.remote_dispatch import waiting_key

pytestmark = pytest.mark.timeout(600)

PENDING = 50


def rollout(run_id: str, tiny_model_dir: Path) -> dict[str, Any]:
    return {"rollout_id": f"w-{uuid.uuid4().hex[:12]}", "server_url": "http://127.0.0.1:9",
            "messages": [{"role": "user", "content": "What is 2 + 2?"}],
            "tokenizer_name": str(tiny_model_dir), "max_turns": 2, "run_id": run_id}


def new_run(server: Server, project: Project, tiny_model_dir: Path) -> str:
    run_id = f"wait-{uuid.uuid4().hex[:8]}"
    r = httpx.post(f"{server.url}/v1/runs", headers=project.headers("ingest"), timeout=60,
                   json={"run_id": run_id, "config": {"tokenizer": str(tiny_model_dir)}})
    assert r.status_code == 201, r.text
    return run_id


def test_waiting_rollouts_hold_no_thread_and_are_capped_per_project(
        start_server: Callable[..., Server], rollout_broker: str, project: Project,
        other_project: Project, tiny_model_dir: Path) -> None:
    import redis

    server = start_server(TRAJSTORE_REDIS_URL=rollout_broker, TRAJSTORE_ROLLOUT_WAIT_S="300",
                          TRAJSTORE_ROLLOUT_WAITING_PER_PROJECT=str(PENDING))
    ours = new_run(server, project, tiny_model_dir)
    theirs = new_run(server, other_project, tiny_model_dir)
    broker = redis.Redis.from_url("unix://" + rollout_broker.removeprefix("redis+socket://"))
    settings = Settings(redis_url=rollout_broker)

    def waiting(p: Project) -> int:
        return int(broker.get(waiting_key(settings, p.name)) or 0)

    async def scenario() -> None:
        limits = httpx.Limits(max_connections=PENDING + 10)
        async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits) as http:
            pending = [asyncio.create_task(http.post(
                "/rollout", json=rollout(ours, tiny_model_dir),
                headers=project.headers("ingest"))) for _ in range(PENDING)]
            try:
                await check(http, pending)
            finally:
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)

    async def check(http: httpx.AsyncClient, pending: list[Any]) -> None:
        deadline = time.monotonic() + 240
        while waiting(project) < PENDING:  # every request was checked and queued
            done = [t for t in pending if t.done()]
            assert not done, done[0].result().text
            assert time.monotonic() < deadline, f"{waiting(project)} waiting"
            await asyncio.sleep(0.2)

        # another project's requests are answered (a generous bound: no timing claim)
        for _ in range(3):
            r = await http.get("/v1/runs", headers=other_project.headers("read"),
                               timeout=60)
            assert r.status_code == 200, r.text
            assert [run["run_id"] for run in r.json()["runs"]] == [theirs]

        # one more of ours is over the cap: 429 naming the setting, nothing queued
        over = rollout(ours, tiny_model_dir)
        r = await http.post("/rollout", json=over, headers=project.headers("ingest"),
                            timeout=60)
        assert r.status_code == 429, r.text
        error = r.json()["error"]
        assert error["code"] == "too_many_waiting"
        assert f"TRAJSTORE_ROLLOUT_WAITING_PER_PROJECT={PENDING}" in error["message"]
        assert waiting(project) == PENDING
        # the other project is under its own cap: its rollout waits too
        other = asyncio.create_task(http.post(
            "/rollout", json=rollout(theirs, tiny_model_dir),
            headers=other_project.headers("ingest")))
        while waiting(other_project) < 1:
            assert not other.done(), other.result().text
            assert time.monotonic() < deadline
            await asyncio.sleep(0.2)
        assert not any(t.done() for t in pending), "nothing answered them"
        other.cancel()
        await asyncio.gather(other, return_exceptions=True)

    try:
        asyncio.run(scenario())
    finally:
        broker.close()
