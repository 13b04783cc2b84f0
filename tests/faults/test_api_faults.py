"""A client retries every append 3 times with the same event ids while the API server is
restarted between attempts: no event is lost and none is stored twice."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from store import migrate
from tests.conftest import PostgresServer
from tests.servers import trajstore_serve


def _key(env: dict[str, str], role: str) -> str:
    out = subprocess.run([sys.executable, "-m", "trajstore", "keys", "create", "--project",
                          "faults", "--role", role], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.timeout(600)
def test_retried_appends_across_api_restarts_store_each_event_once(
        pg_server: PostgresServer, tmp_path: Path) -> None:
    url = pg_server.create_database()
    migrate.upgrade(url)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
    env.update(TRAJSTORE_DATABASE_URL=url, TRAJSTORE_DATA_DIR=str(tmp_path),
               TRAJSTORE_REDIS_URL="redis://127.0.0.1:1/0")  # no broker: the sweep projects
    key = _key(env, "ingest")
    server = trajstore_serve(env=env, log=tmp_path / "api.log")  # restarted on its port
    server.start()
    base = f"http://127.0.0.1:{server.port}"
    headers = {"Authorization": f"Bearer {key}"}
    run_id = f"faults-{uuid.uuid4().hex[:6]}"
    r = httpx.post(f"{base}/v1/runs", json={"run_id": run_id}, headers=headers, timeout=30)
    assert r.status_code == 201, r.text

    sent: list[str] = []
    attempts = Counter[str]()
    restarts = 0

    def post(episode: str, body: dict[str, Any]) -> httpx.Response:
        while True:  # an attempt that meets a restarting server is tried until it lands
            try:
                attempts["sent"] += 1
                return httpx.post(f"{base}/v1/episodes/{episode}/events", json=body,
                                  headers=headers, timeout=30)
            except httpx.TransportError:
                attempts["connection errors"] += 1
                time.sleep(0.2)

    try:
        for i in range(12):
            episode = f"ep-{i}-{uuid.uuid4().hex[:6]}"
            events = [
                {"type": "episode_started", "run_id": run_id, "group_id": f"g{i % 3}",
                 "event_id": str(uuid.uuid4())},
                {"type": "tool_returned", "name": "calculator", "output": str(i),
                 "event_id": str(uuid.uuid4())},
                {"type": "reward_assigned", "value": 1.0, "event_id": str(uuid.uuid4())},
                {"type": "episode_finished", "status": "completed",
                 "event_id": str(uuid.uuid4())},
            ]
            sent += [e["event_id"] for e in events]
            body = {"events": events, "expected_version": 0}
            for attempt in range(3):
                response = post(episode, body)
                assert response.status_code == 200, response.text
                assert response.json()["duplicate"] == (attempt > 0)
                if i % 4 == attempt:  # restart between attempts, at varying points
                    server.stop()
                    server.start()
                    restarts += 1
    finally:
        server.stop()

    import psycopg

    with psycopg.connect(url) as conn:
        stored = Counter(str(r[0]) for r in conn.execute(
            "SELECT event_id FROM events WHERE run_id = %s AND type <> 'run_created'",
            (run_id,)))
    lost = [e for e in sent if e not in stored]
    doubled = [e for e, n in stored.items() if n > 1]
    assert restarts >= 9
    assert (len(lost), len(doubled)) == (0, 0)
    print(f"\nAPI restarts: {restarts} restarts, {len(sent)} events sent 3 times each "
          f"({dict(attempts)}), lost {len(lost)}, duplicated {len(doubled)}")
    pg_server.drop_database(url)
