"""Tokenizers: one cache entry per folder whatever its spelling, a bounded cache, folders only
from the configured roots (422 naming the setting), and concurrent first loads in a fresh
process that all succeed (through the real API and in a bare process)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from store import queries
from store.eventlog import EventStore
from store.settings import Settings
from tests.api.conftest import Project, Server
from tests.api.episodes import create_run, record_group
from workers.engines import tokenizers
from workers.engines.tokenizers import (
    TokenizerNotFound,
    allowed_roots,
    cached_tokenizers,
    load_tokenizer,
    qwen3_tokenizer_dir,
    tokenizer_problem,
    tokenizer_root_problem,
)


@pytest.fixture
def small_cache() -> Iterator[None]:
    tokenizers.configure(cache_size=2)
    yield
    tokenizers.configure(cache_size=Settings().tokenizer_cache_size)


def _folders(tiny_model_dir: Path, base: Path, n: int) -> list[Path]:
    """``n`` copies of the tiny model's tokenizer files."""
    out = []
    for i in range(n):
        folder = base / f"tok-{i}"
        folder.mkdir(parents=True)
        for name in tiny_model_dir.iterdir():
            if name.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
                shutil.copy(name, folder / name.name)
        out.append(folder)
    return out


def test_every_spelling_of_a_folder_is_one_entry(tiny_model_dir: Path, tmp_path: Path) -> None:
    (folder,) = _folders(tiny_model_dir, tmp_path, 1)
    link = tmp_path / "link"
    link.symlink_to(folder)
    spellings = [str(folder), f"{folder}/", f"{folder}/.", f"{folder}/../{folder.name}",
                 f"{tmp_path}//{folder.name}", str(link), f"{link}/"]
    loaded = [load_tokenizer(s) for s in spellings]
    assert all(t is loaded[0] for t in loaded)
    assert [k for k in cached_tokenizers() if k.startswith(str(tmp_path))] == [str(folder)]


def test_the_cache_is_bounded_least_recently_used_first(
        tiny_model_dir: Path, tmp_path: Path, small_cache: None) -> None:
    a, b, c = _folders(tiny_model_dir, tmp_path, 3)
    first = load_tokenizer(str(a))
    load_tokenizer(str(b))
    assert load_tokenizer(str(a)) is first  # a is now the most recent
    load_tokenizer(str(c))  # b goes
    assert cached_tokenizers() == [str(a), str(c)]
    assert load_tokenizer(str(b)) is not None and len(cached_tokenizers()) == 2
    assert str(a) not in cached_tokenizers()


def test_folders_outside_the_roots_are_refused(
        client: TestClient, project: Project, api_settings: Settings, api_store: EventStore,
        tiny_model_dir: Path, tmp_path: Path) -> None:
    roots = allowed_roots(api_settings)
    assert roots is not None
    outside = qwen3_tokenizer_dir()  # real tokenizer files, outside the roots
    escape = tmp_path / "escape"
    escape.symlink_to(outside)
    for name in (str(outside), str(escape), f"{tiny_model_dir}/../../../{outside}",
                 "/etc", "~"):
        assert tokenizer_problem(name, roots=roots) is not None, name
        run_id = f"tok-{uuid.uuid4().hex[:8]}"
        r = client.post("/v1/runs", json={"run_id": run_id, "config": {"tokenizer": name}},
                        headers=project.headers("ingest"))
        assert r.status_code == 422, (name, r.text)
        error = r.json()["error"]
        assert error["field"] == "body.config.tokenizer" and "tokenizer_roots" in \
            error["message"], error
        assert queries.run_record(api_store, run_id) is None
    assert str(outside.resolve()) not in cached_tokenizers()
    for hostile in (f"{tiny_model_dir}/\ud800", f"{tiny_model_dir}/a\x00"):
        assert tokenizer_root_problem(hostile, roots) is not None
        with pytest.raises(TokenizerNotFound):
            load_tokenizer(hostile)
    r = client.post("/v1/runs", json={"run_id": f"tok-{uuid.uuid4().hex[:8]}",
                                      "config": {"model": str(tiny_model_dir)}},
                    headers=project.headers("ingest"))
    assert r.status_code == 201, r.text
    # The same folder, allowed by the setting.
    settings = api_settings.model_copy(update={"tokenizer_roots": f"{outside.parent},/nope"})
    with TestClient(create_app(settings, store=api_store)) as c:
        r = c.post("/v1/runs", json={"run_id": f"tok-{uuid.uuid4().hex[:8]}",
                                     "config": {"tokenizer": str(outside)}},
                   headers=project.headers("ingest"))
        assert r.status_code == 201, r.text
    anything = api_settings.model_copy(update={"tokenizer_roots": "*"})
    assert allowed_roots(anything) is None
    default = Settings(data_dir=tmp_path / "data", checkpoint_root=str(tmp_path / "ckpt"),
                       tokenizer_roots="")
    assert allowed_roots(default) == (str(tmp_path / "data"), str(tmp_path / "ckpt"))
    assert allowed_roots(default.model_copy(update={"checkpoint_root": "s3://b/p"})) == (
        str(tmp_path / "data"),)


def test_remote_rollout_tokenizer_outside_the_roots_is_422(
        client: TestClient, project: Project, api_store: EventStore) -> None:
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    create_run(api_store, run_id, project=project.name)
    r = client.post("/rollout", headers=project.headers("ingest"), json={
        "rollout_id": uuid.uuid4().hex, "server_url": "http://127.0.0.1:9",
        "messages": [{"role": "user", "content": "hi"}],
        "tokenizer_name": str(qwen3_tokenizer_dir()), "run_id": run_id, "max_turns": 1})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["field"] == "body.tokenizer_name" and "tokenizer_roots" in error["message"]


_FRESH = textwrap.dedent("""
    import json, sys, threading
    from workers.engines.tokenizers import cached_tokenizers, load_tokenizer
    names = json.loads(sys.argv[1])
    barrier = threading.Barrier(len(names))
    got, failed = [None] * len(names), []
    def load(i):
        barrier.wait()
        try:
            got[i] = id(load_tokenizer(names[i]))
        except Exception as exc:
            failed.append(f"{type(exc).__name__}: {exc}")
    threads = [threading.Thread(target=load, args=(i,)) for i in range(len(names))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    print(json.dumps({"failed": failed, "distinct": len(set(got)),
                      "cached": cached_tokenizers()}))
""")


def test_concurrent_first_loads_in_a_fresh_process(tiny_model_dir: Path) -> None:
    names = (["qwen3", "Qwen/Qwen3-8B", "QWEN3"] * 8
             + [str(tiny_model_dir), f"{tiny_model_dir}/", f"{tiny_model_dir}/."] * 7)
    out = subprocess.run([sys.executable, "-c", _FRESH, json.dumps(names)], check=True,
                         capture_output=True, text=True, timeout=600)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["failed"] == [] and len(names) == 45
    assert result["distinct"] == 2  # one qwen3, one tiny folder: each loaded once
    assert sorted(result["cached"]) == sorted(["qwen3", str(tiny_model_dir.resolve())])


def test_concurrent_first_loads_through_a_fresh_api_process(
        start_server: Any, api_store: EventStore, project: Project) -> None:
    """44 concurrent timeline requests, each of which loads the run's Qwen3 tokenizer, on a
    server that has loaded none yet: every one answers 200."""
    from workers.engines.tokenizers import load_tokenizer as load

    run_id = f"run-{uuid.uuid4().hex[:8]}"
    create_run(api_store, run_id, project=project.name, group_size=1)
    (episode,) = record_group(api_store, load("qwen3"), run_id=run_id, group_id="g0", size=1)
    server: Server = start_server()
    import httpx

    statuses: list[int | str] = []
    barrier = threading.Barrier(44)

    def fetch() -> None:
        with httpx.Client(timeout=300) as http:
            barrier.wait()
            try:
                r = http.get(f"{server.url}/v1/episodes/{episode}/timelines",
                             headers=project.headers("read"))
            except httpx.HTTPError as exc:  # named in the failure, with the server's log
                statuses.append(f"{type(exc).__name__}: {exc}")
            else:
                statuses.append(r.status_code)

    threads = [threading.Thread(target=fetch) for _ in range(44)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert statuses == [200] * 44, (statuses, server.log_tail())
