"""Exporting a dataset version in every run export format (Python API, REST, command line):
a version derived under rules that keep the recorded rewards gives the same bytes as the
run's export of the same samples and episodes; a re-scored version exports its own
rewards; bad input names what is wrong."""

from __future__ import annotations

import io
import uuid
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from episodes import record_run
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from api.app import create_app
from api.errors import ApiError
from api.exports import FORMATS, prepare, prepare_dataset
from api.keys import KeyStore
from store.db import Database
from store.eventlog import EventStore
from store.settings import Settings, get_settings
from tests.api.conftest import make_project
from workers.datasets import derive_dataset
from workers.replay.jobs.project import project_episode


@pytest.fixture
def api(pg_url: str, tmp_path: Path) -> Iterator[tuple[TestClient, EventStore, KeyStore]]:
    settings = Settings(database_url=pg_url, data_dir=tmp_path, api_key_scrypt_n=1024)
    store = EventStore(Database(pg_url, max_size=4), settings)
    keys = KeyStore(store.db, settings)
    with TestClient(create_app(settings, store=store)) as client:
        yield client, store, keys
    keys.close()
    store.close()


def _safetensors(data: bytes) -> tuple[dict, dict]:
    import json
    import struct

    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + size])
    return header, {"body": data[8 + size:]}


def _bytes(made) -> bytes:
    return b"".join(made.chunks)


def test_a_dataset_version_exports_as_its_run_does(api, qwen3, pg_url: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    client, store, keys = api
    project = make_project(keys)
    run = record_run(store, qwen3, project=project.name)
    for episode in run.episodes.values():
        project_episode(store, episode)
    name = f"exp-{uuid.uuid4().hex[:6]}"
    version = derive_dataset(store, name, [run.run_id], project=project.name).version
    load = {"tokenizer_loader": lambda _name: qwen3}

    # The same samples (group g0: every episode of it is in the version) and the same
    # finished, rewarded episodes give the same bytes.
    same = {"samples": {"group_id": "g0"}, "verl-batch": {"group_id": "g0", "pad_token_id": 0},
            "atif": {"min_reward": 0.0}, "sft": {"min_reward": 0.0}}
    for fmt, options in same.items():
        mine = _bytes(prepare_dataset(store, version, fmt, **options, **load))
        theirs = _bytes(prepare(store, run.run_id, fmt, **options, **load))
        if fmt == "verl-batch":  # safetensors orders its metadata keys at random
            assert _safetensors(mine) == _safetensors(theirs)
        else:
            assert mine == theirs, fmt
    # Every format exports; the prompts are the version's episodes' tasks only.
    for fmt in FORMATS:
        made = prepare_dataset(store, version, fmt, **load,
                               **({"pad_token_id": 0} if fmt == "verl-batch" else {}))
        assert made.filename.startswith(f"{name}@1") and _bytes(made), fmt
    prompts = pq.read_table(io.BytesIO(_bytes(prepare_dataset(store, version,
                                                              "verl-prompts"))))
    tasks = {row["task_id"] for row in prompts.column("extra_info").to_pylist()}
    assert tasks == {"t-a", "t-b"}

    # A re-scored version exports its own rewards, not the run's.
    rescored = derive_dataset(store, name, [run.run_id], {"negatives": {"reward": -0.25}},
                              project=project.name).version
    table = pq.read_table(io.BytesIO(_bytes(prepare_dataset(store, rescored, "samples"))))
    negatives = [r for r in table.to_pylist() if r["kind"] == "negative"]
    assert negatives and {r["reward"] for r in negatives} == {-0.25}

    # Bad input: an option the format does not take, an unknown format, nothing selected.
    with pytest.raises(ApiError, match="does not take min_reward"):
        prepare_dataset(store, version, "samples", min_reward=1.0)
    with pytest.raises(ApiError, match="unknown export format 'csv'"):
        prepare_dataset(store, version, "csv")
    with pytest.raises(ApiError, match=f"dataset {name}@1 has no rows matching"):
        prepare_dataset(store, version, "samples", group_id="g-none")

    # REST: the same bytes; 404 for an unknown version, 422 naming the option; another
    # project's key does not see it.
    headers = project.headers("read")
    r = client.get(f"/v1/datasets/{name}/versions/1/export?group_id=g0", headers=headers)
    assert r.status_code == 200, r.text
    assert r.content == _bytes(prepare(store, run.run_id, "samples", group_id="g0"))
    assert f'filename="{name}@1.parquet"' in r.headers["content-disposition"]
    r = client.get(f"/v1/datasets/{name}/versions/9/export", headers=headers)
    assert r.status_code == 404 and f"no dataset {name!r} version 9" in r.text
    r = client.get(f"/v1/datasets/{name}/versions/1/export?format=samples&min_reward=1",
                   headers=headers)
    assert r.status_code == 422 and r.json()["error"]["field"] == "min_reward", r.text
    other = make_project(keys)
    assert client.get(f"/v1/datasets/{name}/versions/1/export",
                      headers=other.headers("read")).status_code == 404

    # The command line writes the same file.
    from trajstore.cli import app

    monkeypatch.setenv("TRAJSTORE_DATABASE_URL", pg_url)
    monkeypatch.setenv("TRAJSTORE_DATA_DIR", str(tmp_path))
    get_settings.cache_clear()
    try:
        out = tmp_path / "out.safetensors"
        result = CliRunner().invoke(app, [
            "dataset", "export", f"{name}@1", "--format", "verl-batch", "--group", "g0",
            "--pad-token-id", "0", "--project", project.name, "-o", str(out)])
        assert result.exit_code == 0, result.output
        assert _safetensors(out.read_bytes()) == _safetensors(_bytes(prepare(
            store, run.run_id, "verl-batch", group_id="g0", pad_token_id=0)))
        result = CliRunner().invoke(app, [
            "dataset", "export", f"{name}@5", "--project", project.name, "-o", str(out)])
        assert result.exit_code == 1 and f"no dataset '{name}@5'" in result.stderr
    finally:
        get_settings.cache_clear()
