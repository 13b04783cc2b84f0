"""``POST /v1/episodes/{id}/credentials`` and ``DELETE …/credentials/{key_id}``: an admin key
mints the credential of one unfinished episode (what a rollout worker without the database
gives a user's RolloutServer) and revokes it; every refusal names what is wrong. The app runs
in process on the session's PostgreSQL database; a worker's refused mint is played against a
real ``trajstore serve``."""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.keys import KeyStore, parse_key
from store import api_keys
from store.eventlog import EventStore
from store.events import EpisodeFinished, EpisodeStarted, RunConfig, RunCreated
from store.settings import Settings
from store.stream_rules import run_stream_id
from tests.api.conftest import Project, Server
from tests.api.episodes import create_run
from tests.servers import free_port
from workers.rollout.agent_tasks import DIGITS_TASK
from workers.rollout.credentials import ApiCredentials
from workers.rollout.group_log import ApiGroupLog
from workers.rollout.remote_agent import aplay_remote_group


def new_episode(store: EventStore, project: Project, *, finished: bool = False
                ) -> tuple[str, str]:
    """A run of ``project`` and a started (or finished) episode of it: ``(run, episode)``."""
    run_id = f"cred-{uuid.uuid4().hex[:8]}"
    create_run(store, run_id, project=project.name)
    episode_id = f"{run_id}-ep"
    events: list[Any] = [EpisodeStarted(run_id=run_id, group_id="g0")]
    if finished:
        events.append(EpisodeFinished(status="completed"))
    store.append(episode_id, events, "no_stream")
    return run_id, episode_id


def mint(client: TestClient, episode_id: str, headers: dict[str, str], body: Any = None
         ) -> Any:
    return client.post(f"/v1/episodes/{episode_id}/credentials",
                       json={"ttl_s": 120} if body is None else body, headers=headers)


def test_an_admin_key_mints_and_revokes_the_credential_of_one_episode(
        client: TestClient, api_store: EventStore, key_store: KeyStore,
        project: Project) -> None:
    run_id, episode_id = new_episode(api_store, project)
    before = dt.datetime.now(dt.UTC)
    r = mint(client, episode_id, project.headers("admin"))
    after = dt.datetime.now(dt.UTC)
    assert r.status_code == 201, r.text
    body = r.json()
    assert set(body) == {"key_id", "token", "expires_at"}
    assert parse_key(body["token"])[0] == body["key_id"]
    expires = dt.datetime.fromisoformat(body["expires_at"])
    ttl = dt.timedelta(seconds=120)
    assert before + ttl <= expires <= after + ttl
    # Stored as the credential of this episode of this run, in the key's project.
    row = api_keys.key_secret_row(key_store.db, body["key_id"])
    assert row is not None
    assert (row[1], row[2], row[5], row[9], row[10]) == (project.name, "ingest", None,
                                                         run_id, episode_id)
    # Live, it reaches only the episode's routes: any other is 403 naming the episode.
    headers = {"Authorization": f"Bearer {body['token']}"}
    r = client.get("/v1/keys/me", headers=headers)
    assert r.status_code == 403 and episode_id in r.json()["error"]["message"], r.text
    # Revoked: 401 everywhere; revoking again is harmless.
    path = f"/v1/episodes/{episode_id}/credentials/{body['key_id']}"
    r = client.delete(path, headers=project.headers("admin"))
    assert r.status_code == 204 and r.content == b"", r.text
    assert client.get("/v1/keys/me", headers=headers).status_code == 401
    assert client.delete(path, headers=project.headers("admin")).status_code == 204


@pytest.mark.parametrize("role", ["ingest", "read", "train"])
def test_a_key_that_is_not_admin_is_403_naming_the_role(
        role: str, client: TestClient, api_store: EventStore, key_store: KeyStore,
        project: Project) -> None:
    run_id, episode_id = new_episode(api_store, project)
    r = mint(client, episode_id, project.headers(role))
    assert r.status_code == 403 and "needs 'admin'" in r.json()["error"]["message"], r.text
    key_id, _ = api_keys.mint_episode_key(key_store.db, project=project.name, run_id=run_id,
                                          episode_id=episode_id, ttl_s=60,
                                          scrypt=(1024, 8, 1))
    r = client.delete(f"/v1/episodes/{episode_id}/credentials/{key_id}",
                      headers=project.headers(role))
    assert r.status_code == 403 and "needs 'admin'" in r.json()["error"]["message"], r.text
    assert not api_keys.key_revoked(key_store.db, key_id)


def test_another_projects_episode_is_403_and_an_unknown_one_404_naming_it(
        client: TestClient, api_store: EventStore, project: Project,
        other_project: Project) -> None:
    _, episode_id = new_episode(api_store, project)
    r = mint(client, episode_id, other_project.headers("admin"))
    assert r.status_code == 403, r.text
    r = client.delete(f"/v1/episodes/{episode_id}/credentials/0123456789abcdef",
                      headers=other_project.headers("admin"))
    assert r.status_code == 403, r.text
    missing = f"no-such-{uuid.uuid4().hex[:8]}"
    for r in (mint(client, missing, project.headers("admin")),
              client.delete(f"/v1/episodes/{missing}/credentials/0123456789abcdef",
                            headers=project.headers("admin"))):
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "not_found" and missing in r.text, r.text


def test_a_finished_episode_is_409(client: TestClient, api_store: EventStore,
                                   key_store: KeyStore, project: Project) -> None:
    _, episode_id = new_episode(api_store, project, finished=True)
    before = len(key_store.list(project=project.name, include_revoked=True))
    r = mint(client, episode_id, project.headers("admin"))
    assert r.status_code == 409, r.text
    error = r.json()["error"]
    assert error["code"] == "episode_finished" and episode_id in error["message"], error
    assert len(key_store.list(project=project.name, include_revoked=True)) == before


@pytest.mark.parametrize("body", [
    {"ttl_s": 0}, {"ttl_s": 0.5}, {"ttl_s": -60}, {"ttl_s": 86_461}, {"ttl_s": True},
    {"ttl_s": "60"}, {}, {"ttl_s": 60, "role": "admin"}])
def test_a_ttl_out_of_range_is_422_naming_the_field(
        body: dict[str, Any], client: TestClient, api_store: EventStore,
        key_store: KeyStore, project: Project) -> None:
    _, episode_id = new_episode(api_store, project)
    r = mint(client, episode_id, project.headers("admin"), body)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["field"] == ("body.role" if "role" in body else "body.ttl_s"), error
    assert error["field"] in error["message"], error
    assert not [k for k in key_store.list(project=project.name, include_revoked=True)
                if k.episode_id == episode_id]


def test_the_bounds_are_taken(client: TestClient, api_store: EventStore,
                              project: Project) -> None:
    _, episode_id = new_episode(api_store, project)
    for ttl in (1, api_keys.MAX_EPISODE_KEY_TTL_S):
        assert mint(client, episode_id, project.headers("admin"),
                    {"ttl_s": ttl}).status_code == 201


def test_revoking_a_key_that_is_not_the_episodes_credential_is_404(
        client: TestClient, api_store: EventStore, key_store: KeyStore,
        project: Project) -> None:
    _, episode_id = new_episode(api_store, project)
    _, other_episode = new_episode(api_store, project)
    others = mint(client, other_episode, project.headers("admin")).json()["key_id"]
    project_key = key_store.create(project=project.name, role="read").key.key_id
    for key_id in ("0123456789abcdef", others, project_key, "not-a-key-id"):
        r = client.delete(f"/v1/episodes/{episode_id}/credentials/{key_id}",
                          headers=project.headers("admin"))
        assert r.status_code == 404, (key_id, r.text)
        assert episode_id in r.json()["error"]["message"], r.text
    # Neither the other episode's credential nor the project's key was revoked.
    assert not api_keys.key_revoked(key_store.db, others)
    assert not api_keys.key_revoked(key_store.db, project_key)


def test_a_worker_key_that_may_not_mint_ends_the_episodes_error_naming_why(
        start_server: Callable[..., Server], api_store: EventStore, key_store: KeyStore,
        project: Project, api_settings: Settings, rollout_broker: str) -> None:
    """The remote agent's group through the API with an ``ingest`` key for the credentials:
    the API refuses each (403), so each episode ends ``error`` with the API's words and no
    RolloutServer is called (its URL answers nothing)."""
    server = start_server()
    run_id = f"cred-{uuid.uuid4().hex[:8]}"
    config = RunConfig(group_size=2, tokenizer="qwen3", remote_agent={
        "url": f"http://127.0.0.1:{free_port()}", "protocol": "sync-chat", "retries": 0})
    api_store.append(run_stream_id(run_id), [RunCreated(run_id=run_id, project=project.name,
                                                        config=config)], "no_stream")
    log = ApiGroupLog(server.url, api_key=project.admin)
    refused = ApiCredentials(ApiGroupLog(server.url, api_key=project.ingest))
    settings = api_settings.model_copy(update={"remote_agent_store_url": server.url,
                                               "redis_url": rollout_broker})
    result = asyncio.run(aplay_remote_group(
        log=log, credentials=refused, run_id=run_id, task=DIGITS_TASK,
        config=log.run_config(run_id), policy_version=0, settings=settings))
    assert [s.status for s in result.slots] == ["error", "error"]
    for slot in result.slots:
        last = [r.event for r in api_store.read_stream(slot.episode_id)][-1]
        assert last.type == "episode_finished" and last.status == "error"
        assert "credential could not be minted" in (last.reason or ""), last.reason
        assert "needs 'admin'" in (last.reason or ""), last.reason
    episodes = {s.episode_id for s in result.slots}
    assert not [k for k in key_store.list(project=project.name, include_revoked=True)
                if k.episode_id in episodes]
