"""trajstore as the whole trainer of a user's RolloutServer (``RunConfig.remote_agent``):
a real ``trajstore serve`` (the tiny model as its engine), a real rollout worker and
``tests.rollout.agent_server``, a RolloutServer written from the protocol's wire contract,
in each revision. The worker creates each episode, gives the server a credential that
records only it (in its database, or through the API for a worker with ``api_url``),
calls it, records the reward and revokes the credential; the server's
generations go through the store's completions endpoints, whose masks the samples keep token
by token."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from celery import Celery

from api.keys import KeyStore
from store.eventlog import EventStore
from store.settings import Settings
from tests.api.conftest import Project, Server, serve_tiny_engine
from tests.rollout.agent_server import AgentServer
from tests.workers.conftest import Worker
from workers.replay.jobs.project import project_episode
from workers.rollout.group import episode_id_for, group_id_for

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def broker(rollout_broker: str) -> Celery:
    """A producer of the rollout queue with the workers' configuration (key prefix, routes)."""
    from workers.app import celery_settings

    producer = Celery("remote-agent-tests")
    producer.conf.update(celery_settings(Settings(redis_url=rollout_broker), rollout_broker))
    return producer


@pytest.fixture(scope="module")
def module_settings(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    """The module's server and worker settings: one ``trajstore serve`` and one rollout
    worker serve every test of the module (each test's run, project and RolloutServer are
    its own), instead of a process of each started for each test."""
    return Settings(database_url=pg_url, data_dir=tmp_path_factory.mktemp("remote-agent"),
                    api_key_scrypt_n=1024, api_max_request_bytes=2 * 1024 * 1024,
                    api_page_size=50, tokenizer_roots=str(tmp_path_factory.getbasetemp()))


@pytest.fixture(scope="module")
def server(module_settings: Settings, tiny_model_dir: Path) -> Iterator[Server]:
    yield from serve_tiny_engine(module_settings, tiny_model_dir,
                                 Path(module_settings.data_dir) / "server.log")


@pytest.fixture(scope="module")
def worker(server: Server, module_settings: Settings, rollout_broker: str) -> Iterator[Worker]:
    """A ``trajstore worker --queues rollout`` on the module's broker that gives
    RolloutServers ``server``'s URL. Tests that start workers of their own play on a
    broker of their own (:func:`own_broker`), where this one takes nothing of theirs."""
    directory = Path(module_settings.data_dir) / "worker"
    settings = Settings(database_url=module_settings.database_url, redis_url=rollout_broker,
                        data_dir=directory)
    w = Worker(settings, ["--queues", "rollout", "--concurrency", "4"],
               Path(module_settings.data_dir) / "worker.log",
               TRAJSTORE_REMOTE_AGENT_STORE_URL=server.url,
               TRAJSTORE_API_KEY_SCRYPT_N="1024",
               TRAJSTORE_TOKENIZER_ROOTS=module_settings.tokenizer_roots)
    try:
        w.wait_ready()
        yield w
    finally:
        w.stop()


@pytest.fixture
def own_broker(tmp_path: Path) -> tuple[str, Celery]:
    """An embedded Redis of the test's own and a producer of its rollout queue: the workers
    a test starts there are the only ones that take its groups."""
    from store import embedded
    from workers.app import celery_settings

    url = embedded.redis_url(Settings(data_dir=tmp_path / "own-broker"))
    producer = Celery("remote-agent-own")
    producer.conf.update(celery_settings(Settings(redis_url=url), url))
    return url, producer


@pytest.fixture
def agents(tiny_model_dir: Path) -> Iterator[Callable[..., AgentServer]]:
    started: list[AgentServer] = []

    def start(revision: str, **kw: Any) -> AgentServer:
        agent = AgentServer(revision, tiny_model_dir, **kw).start()
        started.append(agent)
        return agent

    yield start
    for agent in started:
        agent.stop()


def new_run(server: Server, project: Project, tiny_model_dir: Path, remote: dict[str, Any],
            group_size: int = 2) -> str:
    run_id = f"agent-{uuid.uuid4().hex[:8]}"
    r = httpx.post(f"{server.url}/v1/runs", headers=project.headers("ingest"), json={
        "run_id": run_id, "config": {
            "group_size": group_size, "tokenizer": str(tiny_model_dir),
            "rollout": {"max_tokens": 1, "temperature": 0.0}, "remote_agent": remote}})
    assert r.status_code == 201, r.text
    return run_id


def play(broker: Celery, store: EventStore, run_id: str, task_id: str = "digits",
         group_size: int = 2, timeout_s: float = 120, rewarded: bool = False) -> list[str]:
    """The group's episode ids once each is finished (and, with ``rewarded``, has its reward:
    after an asynchronous rollout's report the worker appends the run's reward last)."""
    broker.send_task("trajstore.rollout_group", args=[run_id, task_id], queue="rollout")
    group_id = group_id_for(run_id, task_id, 0, 0)
    ids = [episode_id_for(group_id, k) for k in range(group_size)]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = {e.episode_id: e for e in store.list_episodes(run_id)}
        if all(i in rows and rows[i].status != "running"
               and (not rewarded or rows[i].reward is not None) for i in ids):
            return ids
        time.sleep(0.2)
    raise AssertionError(f"the group of {run_id} did not finish: "
                         f"{[(e.episode_id, e.status) for e in store.list_episodes(run_id)]}")


def events(store: EventStore, episode_id: str) -> list[Any]:
    return [r.event for r in store.read_stream(episode_id)]


def expected_mask(calls: list[tuple[list[int], int]]) -> tuple[list[int], list[int]]:
    """The response ids' mask the trainer's buffer says: 1 for each generated token, 0 for
    the tokens between calls."""
    mask: list[int] = []
    generated: list[int] = []
    for token_ids, zeros in calls:
        mask += [1] * len(token_ids) + [0] * zeros
        generated += token_ids
    return mask, generated


@pytest.mark.parametrize("revision", ["sync-chat", "sync-completions", "async"])
def test_the_remote_agent_plays_groups_with_exact_masks_and_rewards(
        revision: str, server: Server, worker: Worker, broker: Celery, api_store: EventStore,
        project: Project, tiny_model_dir: Path, agents: Callable[..., AgentServer]) -> None:
    agent = agents(revision)
    run_id = new_run(server, project, tiny_model_dir,
                     {"url": agent.url, "protocol": "auto" if revision == "async"
                      else revision})
    episodes = play(broker, api_store, run_id, rewarded=True)
    for episode_id in episodes:
        stored = events(api_store, episode_id)
        # (after an asynchronous rollout's report the run's reward comes last, as the latest)
        finished = [e for e in stored if e.type == "episode_finished"]
        assert len(finished) == 1, stored[-1]
        # One token a turn: a sampled token always re-encodes as itself (longer draws of the
        # tiny random model may not, a prefix mismatch no revision could avoid); a last turn
        # cut by max_tokens is reported max_tokens (truncated).
        assert finished[0].status in ("completed", "truncated"), finished[0].reason
        rewards = [e for e in stored if e.type == "reward_assigned"]
        assert rewards and rewards[-1].source == "task"  # the run's reward (digit_share)
        calls = [e for e in stored if e.type == "llm_called"]
        assert len(calls) == agent.turns
        assert [list(c.response_ids) for c in calls] == \
            [ids for ids, _ in agent.expected[episode_id]]
        # Every answer's mask check agreed with the mask the server sent.
        assert [a["mask_check"]["status"] for a in agent.answers[episode_id]] == \
            ["first_call", "ok"], [a["mask_check"] for a in agent.answers[episode_id]]
        # The trainer's buffer token by token: each recorded prompt is the one before, its
        # generated ids and exactly the zeros the server's mask named.
        for before, after, (generated, zeros) in zip(
                calls, calls[1:], agent.expected[episode_id], strict=False):
            prefix = [*before.prompt_ids, *generated]
            assert list(after.prompt_ids[:len(prefix)]) == prefix
            assert len(after.prompt_ids) == len(prefix) + zeros
        assert project_episode(api_store, episode_id).outcome == "written"
    samples = httpx.get(f"{server.url}/v1/runs/{run_id}/samples",
                        headers=project.headers("read")).json()["samples"]
    assert sorted(s["episode_id"] for s in samples) == sorted(episodes)
    for sample in samples:
        # The sample trains exactly the generated ids: ones where the server's calls
        # generated, in order, zeros elsewhere.
        _, generated = expected_mask(agent.expected[sample["episode_id"]])
        mask, ids = sample["response_mask"], sample["response_ids"]
        assert set(mask) <= {0, 1} and mask[0] == 1
        assert [t for t, m in zip(ids, mask, strict=True) if m] == generated
        assert sample["reward"] is not None
    # Each rollout had a credential of its own, revoked once its episode ended.
    tokens = {agent.keys[e] for e in episodes}
    assert len(tokens) == len(episodes) and all(t.startswith("tsk_") for t in tokens)
    for token in tokens:
        r = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 401, r.text


def test_a_worker_writing_through_the_api_plays_a_remote_agent_run(
        server: Server, own_broker: tuple[str, Celery], api_store: EventStore,
        project: Project, tiny_model_dir: Path, agents: Callable[..., AgentServer],
        module_settings: Settings, key_store: KeyStore, tmp_path: Path) -> None:
    """A rollout worker with ``api_url`` (and the project's admin key) mints each episode's
    credential through the API, whose scrypt cost the keys carry (the worker's own is
    another), and revokes it there once the episode ended."""
    from api.keys import parse_key
    from store import api_keys

    agent = agents("sync-chat", turns=1)
    run_id = new_run(server, project, tiny_model_dir, {"url": agent.url,
                                                       "protocol": "sync-chat"})
    broker_url, broker = own_broker
    settings = Settings(database_url=module_settings.database_url, redis_url=broker_url,
                        data_dir=tmp_path / "api-worker")
    w = Worker(settings, ["--queues", "rollout", "--concurrency", "1"],
               tmp_path / "api-worker.log", TRAJSTORE_API_URL=server.url,
               TRAJSTORE_API_KEY=project.admin, TRAJSTORE_REMOTE_AGENT_STORE_URL=server.url,
               TRAJSTORE_API_KEY_SCRYPT_N="2048",
               TRAJSTORE_TOKENIZER_ROOTS=module_settings.tokenizer_roots)
    try:
        w.wait_ready()
        episodes = play(broker, api_store, run_id, rewarded=True)
    finally:
        w.stop()
    text = w.log_path.read_text()
    assert "trajstore.rollout_group" in text and "succeeded" in text, text[-3000:]
    assert "could not revoke" not in text, text[-3000:]
    for episode_id in episodes:
        stored = events(api_store, episode_id)
        assert stored[-1].type == "episode_finished", stored[-1]
        assert stored[-1].status in ("completed", "truncated"), stored[-1].reason
        rewards = [e for e in stored if e.type == "reward_assigned"]
        assert rewards and rewards[-1].source == "task"
        assert [e.type for e in stored].count("llm_called") == 1
    tokens = {agent.keys[e] for e in episodes}
    assert len(tokens) == len(episodes) and all(t.startswith("tsk_") for t in tokens)
    for token in tokens:
        row = api_keys.key_secret_row(key_store.db, parse_key(token)[0])
        assert row is not None
        # Minted by the API (its scrypt cost), for this episode of this run, and revoked.
        assert row[8] == f"scrypt${module_settings.api_key_scrypt_n}$8$1", row[8]
        assert row[9] == run_id and row[10] in episodes and row[5] is not None
        r = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 401, r.text


def test_a_credential_records_only_its_episode(
        server: Server, worker: Worker, broker: Celery, api_store: EventStore,
        project: Project, tiny_model_dir: Path, agents: Callable[..., AgentServer],
        key_store: KeyStore) -> None:
    agent = agents("sync-chat", mode="other_episode", turns=1)
    run_id = new_run(server, project, tiny_model_dir, {"url": agent.url,
                                                       "protocol": "sync-chat"})
    episodes = play(broker, api_store, run_id)
    assert agent.stolen == [403, 403]
    assert all(events(api_store, e)[-1].status in ("completed", "truncated")
               for e in episodes)
    assert api_store.read_stream(f"{episodes[0]}-not-mine") == []
    # While live, a credential reaches no other route either (403, not the run's data).
    from store import api_keys

    key_id, token = api_keys.mint_episode_key(
        key_store.db, project=project.name, run_id=run_id, episode_id=episodes[0],
        ttl_s=60, scrypt=(1024, 8, 1))
    headers = {"Authorization": f"Bearer {token}"}
    assert httpx.get(f"{server.url}/v1/runs/{run_id}", headers=headers).status_code == 403
    r = httpx.post(f"{server.url}/v1/rollout/completed", headers=headers, json={
        "rollout_id": episodes[1], "status": "COMPLETED", "reward": 1.0})
    assert r.status_code == 403 and episodes[0] in r.json()["error"]["message"], r.text
    api_keys.revoke_key(key_store.db, key_id, channel=api_keys.REVOKED_CHANNEL)
    # An expired credential is refused as a revoked one.
    _, token = api_keys.mint_episode_key(
        key_store.db, project=project.name, run_id=run_id, episode_id=episodes[0],
        ttl_s=-1, scrypt=(1024, 8, 1))
    r = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 401


@pytest.mark.parametrize(("mode", "reason"), [
    ("bad_status", "RolloutResponse field 'status'"),
    ("not_json", "not JSON"),
    ("fail", "HTTP 500"),
])
def test_a_misbehaving_server_ends_episodes_error_naming_the_fault(
        mode: str, reason: str, server: Server, worker: Worker, broker: Celery,
        api_store: EventStore, project: Project, tiny_model_dir: Path,
        agents: Callable[..., AgentServer]) -> None:
    agent = agents("sync-chat", mode=mode, turns=1)
    run_id = new_run(server, project, tiny_model_dir, {"url": agent.url,
                                                       "protocol": "sync-chat"})
    for episode_id in play(broker, api_store, run_id):
        last = events(api_store, episode_id)[-1]
        assert last.status == "error" and reason in (last.reason or ""), last.reason


def test_an_unreachable_server_is_retried_a_bounded_number_of_times(
        server: Server, worker: Worker, broker: Celery, api_store: EventStore,
        project: Project, tiny_model_dir: Path) -> None:
    from tests.servers import free_port

    url = f"http://127.0.0.1:{free_port()}"
    run_id = new_run(server, project, tiny_model_dir, {"url": url, "protocol": "sync-chat",
                                                       "retries": 1})
    for episode_id in play(broker, api_store, run_id):
        last = events(api_store, episode_id)[-1]
        assert last.status == "error"
        assert "after 2 attempt(s) (at most 2" in (last.reason or ""), last.reason
    # Probing a server that is not there names the setting to set instead.
    run_id = new_run(server, project, tiny_model_dir, {"url": url})
    for episode_id in play(broker, api_store, run_id):
        last = events(api_store, episode_id)[-1]
        assert last.status == "error" and "unreachable" in (last.reason or ""), last.reason


@pytest.mark.parametrize(("remote", "field"), [
    ({"url": "ftp://example.org"}, "url"),
    ({"url": "http://127.0.0.1:1/", "protocol": "grpc"}, "protocol"),
    ({"url": "http://127.0.0.1:1/", "max_in_flight": 0}, "max_in_flight"),
    ({"protocol": "async"}, "url"),
])
def test_a_bad_remote_agent_is_422_naming_the_field(
        remote: dict[str, Any], field: str, server: Server, project: Project) -> None:
    r = httpx.post(f"{server.url}/v1/runs", headers=project.headers("ingest"), json={
        "run_id": f"bad-{uuid.uuid4().hex[:8]}", "config": {"remote_agent": remote}})
    assert r.status_code == 422, r.text
    assert f"remote_agent.{field}" in r.text or f"remote_agent', '{field}" in r.text, r.text


def test_a_slow_server_does_not_slow_another_projects_requests(
        server: Server, worker: Worker, broker: Celery, api_store: EventStore,
        project: Project, other_project: Project, tiny_model_dir: Path,
        agents: Callable[..., AgentServer]) -> None:
    agent = agents("sync-chat", mode="slow", delay_s=10.0, turns=1)
    run_id = new_run(server, project, tiny_model_dir,
                     {"url": agent.url, "protocol": "sync-chat", "max_in_flight": 4},
                     group_size=4)
    broker.send_task("trajstore.rollout_group", args=[run_id, "digits"], queue="rollout")
    deadline = time.monotonic() + 60
    while agent.playing < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert agent.playing == 4  # every rollout of the group is waiting on the server
    # Meanwhile the API answers another project at once: nothing of it waits on the server.
    for _ in range(20):
        r = httpx.get(f"{server.url}/v1/runs", headers=other_project.headers("read"),
                      )
        assert r.status_code == 200
    assert agent.playing == 4


def test_max_in_flight_holds_across_worker_processes(
        server: Server, own_broker: tuple[str, Celery], api_store: EventStore,
        project: Project, tiny_model_dir: Path, agents: Callable[..., AgentServer],
        module_settings: Settings, tmp_path: Path) -> None:
    """Two rollout worker processes play a group each of a run with max_in_flight 2: the
    RolloutServer never has more than 2 of the run's rollouts at once (each process alone
    would allow 2, 4 together), and every episode ends."""
    agent = agents("sync-chat", mode="slow", delay_s=1.0, turns=1)
    run_id = new_run(server, project, tiny_model_dir,
                     {"url": agent.url, "protocol": "sync-chat", "max_in_flight": 2},
                     group_size=4)
    broker_url, broker = own_broker
    workers = []
    try:
        for name in ("a", "b"):
            settings = Settings(database_url=module_settings.database_url,
                                redis_url=broker_url, data_dir=tmp_path / f"worker-{name}")
            workers.append(Worker(settings, ["--queues", "rollout", "--concurrency", "1"],
                                  tmp_path / f"worker-{name}.log",
                                  TRAJSTORE_REMOTE_AGENT_STORE_URL=server.url,
                                  TRAJSTORE_API_KEY_SCRYPT_N="1024",
                                  TRAJSTORE_TOKENIZER_ROOTS=module_settings.tokenizer_roots))
        for w in workers:
            w.wait_ready()
        for index in (0, 1):
            broker.send_task("trajstore.rollout_group", args=[run_id, "digits"],
                             kwargs={"group_index": index}, queue="rollout")
        ids = [episode_id_for(group_id_for(run_id, "digits", 0, index), k)
               for index in (0, 1) for k in range(4)]
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            rows = {e.episode_id: e for e in api_store.list_episodes(run_id)}
            if all(i in rows and rows[i].status != "running" for i in ids):
                break
            time.sleep(0.2)
        rows = {e.episode_id: e for e in api_store.list_episodes(run_id)}
        assert all(i in rows and rows[i].status in ("completed", "truncated") for i in ids), \
            [(i, rows[i].status if i in rows else None) for i in ids]
        assert agent.max_playing == 2, agent.max_playing
        # Both processes played: each recorded episodes of its own group.
        logs = [(tmp_path / f"worker-{name}.log").read_text() for name in ("a", "b")]
        assert all("trajstore.rollout_group" in text and "succeeded" in text for text in logs)
    finally:
        for w in workers:
            w.stop()
