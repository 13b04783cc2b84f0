"""Datasets over REST (``/v1/datasets``) and the command line (``trajstore dataset``), on the
session's PostgreSQL database with runs recorded by the real chat template."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from episodes import record_run
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from api.app import create_app
from api.derive_slots import DeriveSlots, derive_places
from api.errors import ApiError
from api.keys import KeyStore
from store.datasets import record_trained_by
from store.db import Database
from store.eventlog import EventStore
from store.settings import Settings, get_settings
from tests.api.conftest import Project, make_project
from workers.replay.jobs.project import project_episodes


@pytest.fixture
def api(pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
        ) -> Iterator[tuple[TestClient, EventStore, KeyStore]]:
    # The derivations run in the API's derivation process (spawned with this environment).
    monkeypatch.setenv("DATASET_REWARDS_FAIL_ON_FILE", str(tmp_path / "fail-on"))
    monkeypatch.setenv("DATASET_REWARDS_GATE", str(tmp_path / "gate"))
    settings = Settings(database_url=pg_url, data_dir=tmp_path, api_key_scrypt_n=1024,
                        api_dataset_reward_modules="dataset_rewards, other_pkg")
    store = EventStore(Database(pg_url, max_size=4), settings)
    keys = KeyStore(store.db, settings)
    with TestClient(create_app(settings, store=store)) as client:
        yield client, store, keys
    keys.close()
    store.close()


def test_derive_read_compare_and_delete_over_rest(api, qwen3) -> None:
    client, store, keys = api
    project: Project = make_project(keys)
    other: Project = make_project(keys)
    run = record_run(store, qwen3, project=project.name)
    name = f"rest-{uuid.uuid4().hex[:6]}"
    body: dict[str, Any] = {"name": name, "runs": [run.run_id]}

    # Reading keys derive nothing; another project's run is not this key's.
    assert client.post("/v1/datasets", json=body, headers=project.headers("read")
                       ).status_code == 403
    assert client.post("/v1/datasets", json=body, headers=other.headers("ingest")
                       ).status_code == 403
    r = client.post("/v1/datasets", json={**body, "runs": ["no-such-run"]},
                    headers=project.headers("ingest"))
    assert r.status_code == 404 and "no-such-run" in r.json()["error"]["message"]

    first = client.post("/v1/datasets", json=body, headers=project.headers("ingest"))
    assert first.status_code == 201, first.text
    made = first.json()
    assert made["version"] == 1 and made["created"] is True and made["rows"] > 0
    # Nothing projected: every episode replays (as the command line reports it).
    assert made["from_projection"] == 0 and made["replayed"] == 6, made
    project_episodes(store, list(run.episodes.values()))
    again = client.post("/v1/datasets", json=body, headers=project.headers("admin"))
    assert again.status_code == 200
    assert again.json()["content_hash"] == made["content_hash"]
    assert again.json()["created"] is False
    # The five finished episodes' samples from their projection, the same version.
    assert again.json()["from_projection"] == 5 and again.json()["replayed"] == 1

    second = client.post("/v1/datasets", json={**body, "rules": {
        "negatives": {"reward": -0.25}, "advantage": {"kind": "grpo"}}},
        headers=project.headers("ingest"))
    assert second.status_code == 201 and second.json()["version"] == 2

    listed = client.get("/v1/datasets", headers=project.headers("read")).json()["datasets"]
    assert [(d["name"], d["version"]) for d in listed] == [(name, 1), (name, 2)]
    assert client.get("/v1/datasets", headers=other.headers("read")).json() == {"datasets": []}
    assert client.get(f"/v1/datasets/{name}", headers=other.headers("read")).status_code == 404
    shown = client.get(f"/v1/datasets/{name}/versions/2", headers=project.headers("read"))
    assert shown.json()["rules"]["negatives"]["reward"] == -0.25
    assert shown.json()["from_projection"] is None and shown.json()["replayed"] is None
    rows = client.get(f"/v1/datasets/{name}/versions/2/rows?limit=2",
                      headers=project.headers("read")).json()
    assert len(rows["rows"]) == 2 and rows["next_offset"] == 2
    row = rows["rows"][0]
    assert len(row["token_ids"]) == len(row["loss_mask"]) == len(row["logprobs"])
    assert row["advantage"] is not None

    d = client.get(f"/v1/datasets/diff?a={name}@1&b={name}", headers=project.headers("read"))
    assert d.status_code == 200, d.text
    diff = d.json()
    # A new negative reward and advantages everywhere: every row changed, none added.
    assert diff["added"] == [] and diff["removed"] == []
    assert len(diff["changed"]) == made["rows"] and diff["advantage"] is None
    assert diff["by_failure_type"]["TypeError"]["reward"]["shift"] > 0
    missing = client.get(f"/v1/datasets/diff?a={name}@1&b={name}@9",
                         headers=project.headers("read"))
    assert missing.status_code == 404 and "version 9" in missing.json()["error"]["message"]

    bad = client.post("/v1/datasets", json={**body, "rules": {"negatives": {"cap": -2}}},
                      headers=project.headers("ingest"))
    assert bad.status_code == 422 and "negatives" in bad.json()["error"]["field"]
    empty = client.post("/v1/datasets", json={**body, "rules": {"filters": {
        "tasks": ["none-such"]}}}, headers=project.headers("ingest"))
    assert empty.status_code == 422 and "select nothing" in empty.json()["error"]["message"]
    # A reward function runs in the server: only of the modules its settings name.
    refused = client.post("/v1/datasets", json={**body, "rules": {"reward": {
        "function": "os:getcwd"}}}, headers=project.headers("ingest"))
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"]["field"] == "body.rules.reward.function"
    assert "TRAJSTORE_API_DATASET_REWARD_MODULES" in refused.json()["error"]["message"]
    raising = client.post("/v1/datasets", json={**body, "rules": {"reward": {
        "function": "dataset_rewards:raise_on"}}}, headers=project.headers("ingest"))
    assert raising.status_code == 201  # raise_on raises only for the episodes it is told
    import dataset_rewards

    dataset_rewards.fail_on(run.episodes["a0"])
    failed = client.post("/v1/datasets", json={**body, "name": f"{name}-x", "rules": {
        "reward": {"function": "dataset_rewards:raise_on"}}},
        headers=project.headers("ingest"))
    assert failed.status_code == 422
    assert run.episodes["a0"] in failed.json()["error"]["message"]
    assert failed.json()["error"]["field"] == "body.rules.reward.function"
    assert client.get(f"/v1/datasets/{name}-x", headers=project.headers("read")
                      ).status_code == 404

    # Deleting needs an admin key, and is refused while a training step trained it.
    assert client.delete(f"/v1/datasets/{name}/versions/1", headers=project.headers("ingest")
                         ).status_code == 403
    record_trained_by(store.db, made_id(store, project.name, name, 1), run_id=run.run_id,
                      step=7)
    refused = client.delete(f"/v1/datasets/{name}/versions/1",
                            headers=project.headers("admin"))
    assert refused.status_code == 409 and "step 7" in refused.json()["error"]["message"]
    assert client.delete(f"/v1/datasets/{name}/versions/2", headers=project.headers("admin")
                         ).status_code == 204
    assert client.get(f"/v1/datasets/{name}/versions/2", headers=project.headers("read")
                      ).status_code == 404


def made_id(store: EventStore, project: str, name: str, version: int) -> int:
    from store.datasets import get_version

    found = get_version(store.db, project, name, version)
    assert found is not None
    return found.dataset_id


@pytest.fixture
def cli(pg_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Any]:
    from trajstore.cli import app

    monkeypatch.setenv("TRAJSTORE_DATABASE_URL", pg_url)
    monkeypatch.setenv("TRAJSTORE_DATA_DIR", str(tmp_path))
    get_settings.cache_clear()
    runner = CliRunner()

    def invoke(*args: str) -> Any:
        return runner.invoke(app, ["dataset", *args])

    yield invoke
    get_settings.cache_clear()


def test_the_command_line_derives_lists_shows_and_compares(
        cli, store: EventStore, qwen3, tmp_path: Path) -> None:
    run = record_run(store, qwen3)
    name = f"cli-{uuid.uuid4().hex[:6]}"
    first = cli("derive", name, "--run", run.run_id)
    assert first.exit_code == 0, first.output
    assert f"dataset {name} version 1 (new)" in first.output
    assert "no_reward 1, unfinished 1" in first.output
    # Nothing projected: every episode replays.
    assert "samples of 0 episode(s) taken from their projection, 6 replayed" in first.output
    project_episodes(store, list(run.episodes.values()))
    again = json.loads(cli("derive", name, "--run", run.run_id, "--json").output)
    # The same version, the samples of the five finished episodes from their projection.
    assert again["created"] is False
    assert again["from_projection"] == 5 and again["replayed"] == 1
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps({"filters": {"statuses": ["completed"]}}))
    second = cli("derive", name, "--run", run.run_id, "--rules", str(rules), "--last-turn")
    assert "version 2 (new)" in second.output, second.output
    shown = json.loads(cli("show", f"{name}@2").output)
    assert shown["rules"]["filters"]["statuses"] == ["completed"]
    assert shown["rules"]["train"]["turns"] == "last"
    listed = cli("list", name)
    assert f"{name}@1" in listed.output and f"{name}@2" in listed.output
    diff = cli("diff", f"{name}@1", f"{name}@2")
    assert diff.exit_code == 0 and "removed" in diff.output and "TypeError" in diff.output
    d = json.loads(cli("diff", f"{name}@1", f"{name}@2", "--json").output)
    assert {k["episode_id"] for k in d["removed"]} == {run.episodes["err"]}

    empty = cli("derive", name, "--run", run.run_id, "--task", "none-such")
    assert empty.exit_code == 1 and "select nothing" in empty.output
    unknown = cli("derive", name, "--run", "no-such-run")
    assert unknown.exit_code == 1 and "no run 'no-such-run'" in unknown.output
    assert cli("show", f"{name}@5").exit_code == 1
    assert "deleted" in cli("delete", f"{name}@2").output
    # Its number is not given again: the same rules make version 3.
    assert "version 3 (new)" in cli("derive", name, "--run", run.run_id, "--status",
                                    "completed", "--last-turn").output


def test_one_project_derives_once_at_a_time_off_the_api_interpreter(api, qwen3,
                                                                    tmp_path: Path) -> None:
    """A derivation holds one of its project's places (one by default) and replays on the
    API's derivation process: a second of the same project is answered 429 naming the
    setting, and another project's derivation is made meanwhile."""
    client, store, keys = api
    project: Project = make_project(keys)
    other: Project = make_project(keys)
    run = record_run(store, qwen3, project=project.name)
    neighbour = record_run(store, qwen3, project=other.name)
    gate = tmp_path / "gate"
    held: dict[str, Any] = {}

    def derive_held() -> None:
        held["response"] = client.post("/v1/datasets", json={
            "name": "held", "runs": [run.run_id],
            "rules": {"reward": {"function": "dataset_rewards:gated"}}},
            headers=project.headers("ingest"))

    thread = threading.Thread(target=derive_held)
    thread.start()
    try:
        started = Path(f"{gate}.started")
        deadline = time.monotonic() + 120
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started.exists(), "the held derivation never reached its reward function"
        # Its episodes are replayed in another process than the API's.
        assert int(started.read_text()) != os.getpid()

        second = client.post("/v1/datasets", json={"name": "second", "runs": [run.run_id]},
                             headers=project.headers("ingest"))
        assert second.status_code == 429, second.text
        assert "TRAJSTORE_API_DERIVE_PROJECT_RUNNING=1" in second.json()["error"]["message"]
        assert second.headers["Retry-After"] == "5"
        assert client.get("/v1/datasets/second", headers=project.headers("read")
                          ).status_code == 404

        # The neighbour derives while the held derivation still waits for its grader.
        made = client.post("/v1/datasets", json={"name": "theirs", "runs": [neighbour.run_id]},
                           headers=other.headers("ingest"))
        assert made.status_code == 201, made.text
        assert thread.is_alive() and "response" not in held
    finally:
        Path(f"{gate}.open").touch()
        thread.join(timeout=120)
    assert held["response"].status_code == 201, held["response"].text

    # The place is given back, after an error too.
    import dataset_rewards

    dataset_rewards.fail_on(run.episodes["a0"])
    failed = client.post("/v1/datasets", json={"name": "fails", "runs": [run.run_id], "rules": {
        "reward": {"function": "dataset_rewards:raise_on"}}}, headers=project.headers("ingest"))
    assert failed.status_code == 422, failed.text
    again = client.post("/v1/datasets", json={"name": "second", "runs": [run.run_id]},
                        headers=project.headers("ingest"))
    assert again.status_code == 201, again.text


def test_derivation_places_and_processes(pg_url: str) -> None:
    """Every limit of ``DeriveSlots`` refuses with a 429 naming its setting, and gives its
    place back when the derivation ends; the project's places are the ``ProjectPlaces`` it
    is given."""
    places = derive_places()
    slots = DeriveSlots(pg_url, places=places, per_project=1, processes=1)
    try:
        with slots.slot("p1") as pool:
            assert pool is not None and pool.jobs == 1 and places.running("p1") == 1
            with pytest.raises(ApiError, match="TRAJSTORE_API_DERIVE_PROJECT_RUNNING=1") as one:
                with slots.slot("p1"):
                    pass
            assert one.value.status == 429 and one.value.headers == {"Retry-After": "5"}
            assert "project 'p1'" in one.value.message
            assert "trajstore dataset derive --jobs N" in one.value.message
            with pytest.raises(ApiError, match="TRAJSTORE_API_DERIVE_PROCESSES=1") as full:
                with slots.slot("p2"):
                    pass
            assert full.value.status == 429 and slots.running("p2") == 0
        with slots.slot("p2") as again:
            assert again is pool  # the same warm process
        assert slots.running("p1") == slots.running("p2") == 0
    finally:
        slots.close()
    inline = DeriveSlots(pg_url, places=derive_places(), per_project=2, processes=0)
    with inline.slot("p1") as none, inline.slot("p1") as still_none:
        assert none is None and still_none is None and inline.running("p1") == 2
