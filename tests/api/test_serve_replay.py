"""``trajstore serve`` alone replays what it ingests, a replay of each project in turn, and
after a restart what it had queued when it died; with ``--no-replay`` and no replay
worker it says so loudly at start and in ``/ready``. Real ``trajstore serve`` processes on a
database of their own (a replay follower reads the whole log it is given), episodes sent over
REST, rendered with the real Qwen3 chat template."""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.keys import KeyStore
from store.db import Database
from store.eventlog import NO_STREAM, EventStore
from store.events import Event
from store.followers import NO_REPLAY
from store.projections import Projections
from store.settings import Settings
from tests.api.episodes import episode_events
from tests.servers import ServerProcess, free_port
from tests.workers.test_replay_dispatch import project_run


@pytest.fixture
def own_db(migrated_db: str) -> str:
    """A database of its own: a replay follower reads the whole log it is given."""
    return migrated_db


def _serve(url: str, tmp_path: Path, *flags: str, env_add: dict[str, str] | None = None
           ) -> ServerProcess:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
    env.update(TRAJSTORE_DATABASE_URL=url, TRAJSTORE_DATA_DIR=str(tmp_path),
               TRAJSTORE_API_KEY_SCRYPT_N="1024", **(env_add or {}))
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


# --- fairness between projects (workers.replay.jobs.inprocess) ---------------------------

def _store(url: str, tmp_path: Path) -> EventStore:
    return EventStore(Database(url, max_size=2), Settings(database_url=url, data_dir=tmp_path))


def _record(store: EventStore, tokenizer: Any, run_id: str, seed: int) -> str:
    episode = f"ep-{seed}-{uuid.uuid4().hex[:8]}"
    store.append(episode, episode_events(tokenizer, run_id=run_id, group_id="g0", a=seed,
                                         b=1, reward=1.0), NO_STREAM)
    return episode


def _projected_at(store: EventStore, episodes: list[str]) -> dict[str, Any]:
    with store.db.connection() as conn:
        return dict(conn.execute("SELECT episode_id, projected_at FROM episodes"
                                 " WHERE episode_id = ANY(%s) AND projected_version IS NOT NULL",
                                 (episodes,)).fetchall())


def _written_once(store: EventStore, episodes: list[str]) -> None:
    """Every episode projected at its last version, with its one sample (a second write
    would have doubled it)."""
    with store.db.connection() as conn:
        samples = dict(conn.execute("SELECT episode_id, count(*) FROM samples"
                                    " WHERE episode_id = ANY(%s) GROUP BY episode_id",
                                    (episodes,)).fetchall())
    assert samples == dict.fromkeys(episodes, 1), samples
    projections = Projections(store)
    assert all(projections.projected_version(e) == store.stream_version(e) for e in episodes)


def _wait(predicate: Any, server: ServerProcess, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}: " \
                                            f"{server.log_tail()}"
        time.sleep(0.25)


def _following(server: ServerProcess) -> None:
    _wait(lambda: httpx.get(f"{server.url}/ready").json()["replay"] == "following", server,
          "the replay follower to lead", timeout=60)


FLOOD = 30


@pytest.mark.timeout(600)
def test_serve_replays_a_neighbours_episode_before_a_flooding_projects_backlog(
        own_db: str, tmp_path: Path) -> None:
    """A project finishes 30 episodes, then another project one: the server's replay takes
    the projects in turn, so at most a couple of the flood's replays go after the
    neighbour's episode arrived and before it (in log order all 30 would), and every episode
    of both is projected once. Each replay sleeps a little in its transaction, so the
    flood's backlog is still there when the neighbour's episode comes."""
    from workers.engines.tokenizers import load_tokenizer

    qwen3 = load_tokenizer("qwen3")
    store = _store(own_db, tmp_path)
    try:
        flood_run, neighbour_run = project_run(store, "flood"), project_run(store, "neighbour")
        with _serve(own_db, tmp_path, env_add={"TRAJSTORE_FAULT_REPLAY_DELAY_S": "0.2"}
                    ) as server:
            _following(server)
            flood = [_record(store, qwen3, flood_run, i) for i in range(FLOOD)]
            neighbour = _record(store, qwen3, neighbour_run, 1000)
            with store.db.connection() as conn:
                row = conn.execute("SELECT clock_timestamp()").fetchone()
            assert row is not None
            appended = row[0]
            _wait(lambda: neighbour in _projected_at(store, [neighbour]), server,
                  "the neighbour's episode")
            at = _projected_at(store, [neighbour])[neighbour]
            before = [t for t in _projected_at(store, flood).values() if t < at]
            after_append = [t for t in before if t >= appended]
            assert len(after_append) <= 2, f"{len(after_append)} of the flood's replays went " \
                                           "first after the neighbour's episode arrived"
            assert len(before) < FLOOD, "the flood's backlog was all replayed first"
            _wait(lambda: len(_projected_at(store, flood)) == FLOOD, server,
                  "the flood's backlog")
            _written_once(store, [*flood, neighbour])
    finally:
        store.close()


@pytest.mark.timeout(600)
def test_episodes_queued_in_a_server_killed_before_their_replay_are_replayed_after_a_restart(
        own_db: str, tmp_path: Path) -> None:
    """The follower saves its position once a batch is queued in the process, not once it
    is projected: a server killed with replays queued leaves them to the next server's pass
    over PostgreSQL's unprojected episodes (no sweep runs beside a lone server), and every
    episode is projected, once."""
    from store.followers import REPLAY_FOLLOWER, load_cursor
    from workers.engines.tokenizers import load_tokenizer

    qwen3 = load_tokenizer("qwen3")
    store = _store(own_db, tmp_path)
    try:
        run_id = project_run(store, "flood")
        slow = _serve(own_db, tmp_path, env_add={"TRAJSTORE_FAULT_REPLAY_DELAY_S": "2"})
        with slow:
            _following(slow)
            episodes = [_record(store, qwen3, run_id, i) for i in range(8)]
            last = store.get_episode(episodes[-1])[-1].log_position
            _wait(lambda: (c := load_cursor(store, REPLAY_FOLLOWER)) is not None and c >= last,
                  slow, "the follower to queue every episode")
            assert len(_projected_at(store, episodes)) < len(episodes)
            assert slow.proc is not None
            os.killpg(slow.proc.pid, signal.SIGKILL)
            slow.proc.wait(timeout=30)
        with _serve(own_db, tmp_path) as server:
            _wait(lambda: len(_projected_at(store, episodes)) == len(episodes), server,
                  "the episodes the killed server had queued")
            _written_once(store, episodes)
    finally:
        store.close()
