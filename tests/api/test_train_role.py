"""The ``train`` role: reading never changes state. Leasing, acknowledging, appending
``policy_updated`` and engine reports need a train (or admin) key; a ``policy_updated`` must
carry the run's newest version + 1 and a checkpoint under the checkpoint root. An ingest or
read key that tries is refused, and the run's trainer keeps its samples."""

from __future__ import annotations

import json
import os
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from store.eventlog import EventStore, run_stream_id
from store.serving import checkpoint_problem
from store.settings import Settings
from tests.api.conftest import Project
from tests.api.episodes import create_run, record_group


@pytest.fixture(scope="module")
def qwen3() -> Any:
    from workers.engines.tokenizers import load_tokenizer

    return load_tokenizer("qwen3")


@pytest.fixture
def run(api_store: EventStore, project: Project, qwen3: Any) -> str:
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    create_run(api_store, run_id, project=project.name, group_size=2)
    record_group(api_store, qwen3, run_id=run_id, group_id="g0")
    return run_id


def _update(version: Any, checkpoint: str | None = None, **extra: Any) -> dict[str, Any]:
    event: dict[str, Any] = {"type": "policy_updated", "version": version, "step": 1, **extra}
    if checkpoint is not None:
        event["checkpoint"] = checkpoint
    return event


def _append(client: TestClient, project: Project, run_id: str, *events: dict[str, Any],
            role: str = "train", expected: Any = "any") -> Any:
    # Serialised here, ASCII: a lone surrogate travels as its JSON escape.
    body = json.dumps({"expected_version": expected, "events": list(events)})
    return client.post(f"/v1/runs/{run_id}/events", content=body,
                       headers={**project.headers(role), "Content-Type": "application/json"})


def test_ingest_and_read_keys_change_no_training_state(
        client: TestClient, project: Project, run: str, api_store: EventStore) -> None:
    stream = run_stream_id(run)
    before = api_store.stream_version(stream)
    # An ingest key (the agents' key) cannot move the run's policy: 403 naming the role.
    for role in ("ingest", "read"):
        r = _append(client, project, run, _update(2**31 - 1), role=role)
        assert r.status_code == 403, r.text
        assert "needs 'train'" in r.json()["error"]["message"]
        r = client.post(f"/v1/runs/{run}/served", headers=project.headers(role), json={
            "version": 0, "engine": "e", "backend": "B"})
        assert r.status_code == 403 and "needs 'train'" in r.json()["error"]["message"]
    # A read key reads, and cannot take leases.
    r = client.post(f"/v1/runs/{run}/leases", json={"groups": 1},
                    headers=project.headers("read"))
    assert r.status_code == 403 and "needs 'train'" in r.json()["error"]["message"]
    assert client.get(f"/v1/runs/{run}", headers=project.headers("read")).status_code == 200
    assert api_store.stream_version(stream) == before
    run_out = client.get(f"/v1/runs/{run}", headers=project.headers("train")).json()
    assert run_out["policy_version"] == 0 and run_out["samples"].get("leased", 0) == 0
    # The trainer, strict about staleness, still gets the group: nothing became stale.
    lease = client.post(f"/v1/runs/{run}/leases", headers=project.headers("train"),
                        json={"groups": 1, "max_staleness": 0})
    assert lease.status_code == 200, lease.text
    assert lease.json()["groups"] == ["g0"] and lease.json()["skipped_stale"] == 0
    ack = client.post(f"/v1/leases/{lease.json()['lease_id']}/ack",
                      json={"policy_version": 1}, headers=project.headers("read"))
    assert ack.status_code == 403
    ack = client.post(f"/v1/leases/{lease.json()['lease_id']}/ack",
                      json={"policy_version": 1}, headers=project.headers("train"))
    assert ack.status_code == 200 and ack.json()["consumed"] > 0


def test_a_policy_version_is_the_newest_plus_one(
        client: TestClient, project: Project, run: str, api_store: EventStore) -> None:
    stream = run_stream_id(run)
    for bad in (2**31 - 1, 2, 0, -1, True, "1", 1.0, None):
        before = api_store.stream_version(stream)
        r = _append(client, project, run, _update(bad))
        assert r.status_code == 422, (bad, r.text)
        error = r.json()["error"]
        assert error["field"] == "version" and error["event_index"] == 0, error
        assert error["expected_policy_version"] == 1 and "expected 1" in error["message"]
        assert api_store.stream_version(stream) == before
    event_id = str(uuid.uuid4())
    expected = api_store.stream_version(stream)
    first = _append(client, project, run, _update(1, event_id=event_id), expected=expected)
    assert first.status_code == 200, first.text
    # A faithful retry is a retry, not a stale version (nor a stale expected version).
    for retry_expected in ("any", expected):
        again = _append(client, project, run, _update(1, event_id=event_id),
                        expected=retry_expected)
        assert again.status_code == 200 and again.json()["duplicate"] is True, again.text
    clash = _append(client, project, run, _update(1, "/etc", event_id=event_id))
    assert clash.status_code == 422 and clash.json()["error"]["field"] == "checkpoint"
    other = _append(client, project, run, {**_update(1, event_id=event_id), "step": 9})
    assert other.status_code == 409, other.text  # another event under a stored id
    r = _append(client, project, run, _update(1))
    assert r.status_code == 422 and r.json()["error"]["expected_policy_version"] == 2
    # A batch counts on: 2, 3 is right; 4, 6 names the second event and 5.
    assert _append(client, project, run, _update(2), _update(3)).status_code == 200
    r = _append(client, project, run, _update(4), _update(6))
    assert r.status_code == 422 and r.json()["error"]["event_index"] == 1
    assert r.json()["error"]["expected_policy_version"] == 5
    # The client's own expected version still holds (409, as for any stream).
    stale = _append(client, project, run, _update(4), expected=1)
    assert stale.status_code == 409 and stale.json()["error"]["code"] == "version_conflict"
    assert client.get(f"/v1/runs/{run}",
                      headers=project.headers("read")).json()["policy_version"] == 3
    # An admin key may do what a train key may.
    assert _append(client, project, run, _update(4), role="admin").status_code == 200


def test_racing_appends_record_each_version_once(
        client: TestClient, project: Project, run: str, api_store: EventStore) -> None:
    results: list[int] = []
    barrier = threading.Barrier(6)

    def attempt() -> None:
        barrier.wait()
        results.append(_append(client, project, run, _update(1)).status_code)

    threads = [threading.Thread(target=attempt) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [200] + [422] * 5, results
    versions = [getattr(e.event, "version", None)
                for e in api_store.read_stream(run_stream_id(run)) if e.type == "policy_updated"]
    assert versions == [1]


def _bad_checkpoints(root: Path, tmp_path: Path) -> list[str]:
    escape = tmp_path / "escape"
    escape.symlink_to("/etc")
    linked = root / "run" / "linked"
    linked.parent.mkdir(parents=True, exist_ok=True)
    linked.symlink_to("/etc")
    return ["/etc", "/etc/passwd", "file:///", "file:///etc/passwd",
            "http://169.254.169.254/latest/meta-data/", "s3://elsewhere/ckpt/v1",
            f"{root}/../outside", f"{root}/run/../../outside",
            str(root), f"{root}/", f"{root}x/v1", "ckpt/v1", "", "   ",
            f"file://{root}/../etc", f"file://other-host{root}/v1", str(linked),
            f"{escape}/v1", f"{root}/run/linked/passwd", f"{root}/run/\ud800",
            f"{root}/run/a\x00b", "s3://b/p/\ud800"]


def test_checkpoints_lie_under_the_checkpoint_root(
        client: TestClient, project: Project, run: str, api_store: EventStore,
        api_settings: Settings, tmp_path: Path) -> None:
    root = api_settings.data_dir / "checkpoints"
    stream = run_stream_id(run)
    before = api_store.stream_version(stream)
    for bad in _bad_checkpoints(root, tmp_path):
        r = _append(client, project, run, _update(1, bad))
        assert r.status_code == 422, (bad, r.text)
        error = r.json()["error"]
        assert error["field"] == "checkpoint" and error["event_index"] == 0, (bad, error)
        assert "checkpoint_root" in error["message"] or "'..'" in error["message"], error
    assert api_store.stream_version(stream) == before
    good = _append(client, project, run, _update(1, f"{root}/{run}/v000001"))
    assert good.status_code == 200, good.text
    as_url = _append(client, project, run, _update(2, f"file://{root}/{run}/v000002"))
    assert as_url.status_code == 200, as_url.text
    # The check is the API's: an episode stream never takes policy_updated at all.
    r = client.post(f"/v1/episodes/ep-{uuid.uuid4().hex[:6]}/events",
                    headers=project.headers("admin"), json={
                        "expected_version": "any", "events": [_update(3, "/etc")]})
    assert r.status_code in (404, 422)


def test_the_checkpoint_root_is_a_setting(api_settings: Settings, api_store: EventStore,
                                          project: Project, run: str, tmp_path: Path) -> None:
    shared = tmp_path / "shared-ckpts"
    settings = api_settings.model_copy(update={"checkpoint_root": str(shared)})
    with TestClient(create_app(settings, store=api_store)) as c:
        default = api_settings.data_dir / "checkpoints" / run / "v1"
        r = _append(c, project, run, _update(1, str(default)))
        assert r.status_code == 422 and str(shared) in r.json()["error"]["message"]
        assert _append(c, project, run, _update(1, f"{shared}/{run}/v1")).status_code == 200


@pytest.mark.parametrize("location", [
    "s3://bucket/prefix/run/v1", "S3://BUCKET/prefix/run/v1/", "s3://bucket/prefix/a/b/c",
])
def test_a_url_root_takes_its_own_prefix(location: str) -> None:
    assert checkpoint_problem(location, "s3://bucket/prefix") is None


@pytest.mark.parametrize("location", [
    "s3://elsewhere/prefix/v1", "s3://bucket/prefixx/v1", "s3://bucket/prefix",
    "s3://bucket/prefix/", "s3://bucket/prefix/../other/v1", "s3://bucket/prefix/%2E%2E/v1",
    "s3://bucket/prefix/./v1", "gs://bucket/prefix/v1", "/data/checkpoints/v1",
    "s3://bucket/prefix/v1?versionId=1", "s3://bucket/other/v1", "http://169.254.169.254/",
])
def test_a_url_root_refuses_everything_else(location: str) -> None:
    assert checkpoint_problem(location, "s3://bucket/prefix") is not None


def test_a_local_root_resolves_links(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    (root / "r").mkdir(parents=True)
    # A root reached through a link: the same folder, spelled two ways.
    alias = tmp_path / "alias"
    alias.symlink_to(root)
    assert checkpoint_problem(f"{alias}/r/v1", str(root)) is None
    assert checkpoint_problem(f"{root}/r/v1", str(alias)) is None
    assert checkpoint_problem(f"{root}/r/v1", f"file://{root}") is None
    os.symlink(tmp_path, root / "r" / "up")
    assert checkpoint_problem(f"{root}/r/up/x", str(root)) is not None
    assert checkpoint_problem(None, str(root)) is None
    assert checkpoint_problem(7, str(root)) is not None
