"""``trajstore serve`` alone replays what it ingests; with ``--no-replay`` and no replay
worker it says so loudly at start and in ``/ready``. Real ``trajstore serve`` processes on a
database of their own (a replay follower reads the whole log it is given), episodes sent over
REST, rendered with the real Qwen3 chat template."""

from __future__ import annotations

import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.keys import KeyStore
from store.db import Database
from store.events import Event
from store.followers import NO_REPLAY
from store.settings import Settings
from tests.api.episodes import episode_events
from tests.servers import ServerProcess, free_port


@pytest.fixture
def own_db(migrated_db: str) -> str:
    """A database of its own: a replay follower reads the whole log it is given."""
    return migrated_db


def _serve(url: str, tmp_path: Path, *flags: str) -> ServerProcess:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
    env.update(TRAJSTORE_DATABASE_URL=url, TRAJSTORE_DATA_DIR=str(tmp_path),
               TRAJSTORE_API_KEY_SCRYPT_N="1024")
    return ServerProcess([sys.executable, "-m", "trajstore", "serve", "--host", "127.0.0.1",
                          "--port", str(port), *flags], port=port,
                         log=tmp_path / f"serve-{port}.log", env=env)


def _key(url: str, tmp_path: Path) -> str:
    settings = Settings(database_url=url, data_dir=tmp_path, api_key_scrypt_n=1024)
    db = Database(url, max_size=1)
    keys = KeyStore(db, settings)
    try:
        return keys.create(project="p", role="admin").token
    finally:
        keys.close()
        db.close()


def _wire(event: Event) -> dict[str, Any]:
    body = event.model_dump(mode="json", exclude={"prompt_ids", "response_ids", "logprobs"})
    body.update({name: array.tolist() for name, array in event.token_payloads().items()})
    body["type"] = event.type
    return body


def _ingest(base: str, key: str) -> str:
    """A run and one finished episode, over REST; returns the episode id."""
    from workers.engines.tokenizers import load_tokenizer

    headers = {"Authorization": f"Bearer {key}"}
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    r = httpx.post(f"{base}/v1/runs", headers=headers,
                   json={"run_id": run_id, "config": {"group_size": 1, "tokenizer": "qwen3"}})
    assert r.status_code == 201, r.text
    episode = f"ep-{uuid.uuid4().hex[:8]}"
    events = episode_events(load_tokenizer("qwen3"), run_id=run_id, group_id="g0", a=3, b=4,
                            reward=1.0)
    r = httpx.post(f"{base}/v1/episodes/{episode}/events", headers=headers, timeout=60,
                   json={"expected_version": "no_stream",
                         "events": [_wire(e) for e in events]})
    assert r.status_code == 200, r.text
    return episode


def test_serve_alone_replays_what_it_ingests(own_db: str, tmp_path: Path) -> None:
    key = _key(own_db, tmp_path)
    with _serve(own_db, tmp_path) as server:
        ready = httpx.get(f"{server.url}/ready").json()
        deadline = time.monotonic() + 60
        while ready["replay"] != "following":  # the follower takes its lock as it starts
            assert time.monotonic() < deadline, ready
            time.sleep(0.5)
            ready = httpx.get(f"{server.url}/ready").json()
        assert ready["warnings"] == []
        episode = _ingest(server.url, key)
        headers = {"Authorization": f"Bearer {key}"}
        deadline = time.monotonic() + 120
        while True:
            summary = httpx.get(f"{server.url}/v1/episodes/{episode}", params={"tokens": False},
                                headers=headers).json()["summary"]
            if summary.get("projected_version") is not None:
                break
            assert time.monotonic() < deadline, (summary, server.log_tail())
            time.sleep(0.5)
        assert summary["status"] == "completed", summary
        samples = httpx.get(f"{server.url}/v1/runs/{summary['run_id']}/samples",
                            headers=headers).json()
        assert {s["episode_id"] for s in samples["samples"]} == {episode}, samples
    assert "replayed in this process" in server.log_path.read_text()


def test_no_replay_and_no_worker_is_said_at_start_and_in_ready(own_db: str,
                                                                tmp_path: Path) -> None:
    with _serve(own_db, tmp_path, "--no-replay") as server:
        answer = httpx.get(f"{server.url}/ready")
        assert answer.status_code == 200  # ingest still works; nothing would replay it
        ready = answer.json()
        assert ready["status"] == "ready" and ready["replay"] == "none", ready
        assert ready["warnings"] == [NO_REPLAY]
        assert "trajstore worker --queues replay" in NO_REPLAY
    assert f"WARNING: {NO_REPLAY}" in server.log_path.read_text()
