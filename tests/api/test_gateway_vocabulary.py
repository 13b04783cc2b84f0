"""The in-process engine records only runs whose tokenizer is its own vocabulary: a run of
another tokenizer is refused (409 naming both) before anything is created or generated, and
an engine folder whose tokenizer does not fit its model fails the API's start."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from store.eventlog import EventStore
from store.settings import Settings
from tests.api.conftest import Project
from workers.engines.tokenizers import qwen3_tokenizer_dir

pytestmark = pytest.mark.timeout(600)

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


def _app(settings: Settings, store: EventStore, model: Path) -> TestClient:
    return TestClient(create_app(settings.model_copy(update={
        "gateway_engine_model": str(model), "gateway_max_tokens": 8}), store=store))


@pytest.fixture
def gateway(api_settings: Settings, api_store: EventStore, tiny_model_dir: Path
            ) -> Iterator[TestClient]:
    with _app(api_settings, api_store, tiny_model_dir) as c:
        yield c


def _run(client: TestClient, project: Project, tokenizer: str) -> str:
    run_id = f"vocab-{uuid.uuid4().hex[:8]}"
    made = client.post("/v1/runs", headers=project.headers("ingest"),
                       json={"run_id": run_id, "config": {"tokenizer": tokenizer}})
    assert made.status_code == 201, made.text
    return run_id


def test_a_run_of_another_tokenizer_is_refused_naming_both(
        gateway: TestClient, project: Project, api_store: EventStore,
        tiny_model_dir: Path) -> None:
    qwen = _run(gateway, project, "Qwen/Qwen3-8B")
    episode = f"ep-{uuid.uuid4().hex[:8]}"
    refused = gateway.post(f"/v1/runs/{qwen}/episodes/{episode}/chat/completions",
                           headers=project.headers("ingest"),
                           json={"model": "tiny", "messages": MESSAGES})
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["code"] == "tokenizer_mismatch"
    assert "Qwen/Qwen3-8B" in error["message"] and str(tiny_model_dir) in error["message"]
    assert api_store.read_stream(episode) == []  # nothing created, nothing recorded
    # An existing episode of such a run is refused the same way (and streamed calls too).
    made = gateway.post(f"/v1/runs/{qwen}/episodes", headers=project.headers("ingest"),
                        json={"group_id": "g"})
    existing = made.json()["episode_id"]
    for stream in (False, True):
        again = gateway.post("/v1/chat/completions", json={
            "model": "tiny", "messages": MESSAGES, "stream": stream},
            headers={**project.headers("ingest"), "X-Trajstore-Episode": existing})
        assert again.status_code == 409, again.text
    assert [r.type for r in api_store.read_stream(existing)] == ["episode_started"]
    # The engine's own tokenizer, by any of its names, is accepted.
    for name in ("tiny", str(tiny_model_dir)):
        run_id = _run(gateway, project, name)
        ok = gateway.post(f"/v1/runs/{run_id}/episodes/e-{uuid.uuid4().hex[:6]}"
                          "/chat/completions", headers=project.headers("ingest"),
                          json={"model": "tiny", "messages": MESSAGES})
        assert ok.status_code == 200, ok.text


def test_an_engine_whose_tokenizer_does_not_fit_its_model_is_refused(
        api_settings: Settings, api_store: EventStore, tiny_model_dir: Path,
        tmp_path: Path) -> None:
    """The API loads its engine when it starts: such an engine fails the start."""
    odd = tmp_path / "odd-engine"
    shutil.copytree(tiny_model_dir, odd)
    for f in odd.glob("*"):
        if f.name.startswith(("tokenizer", "vocab", "merges", "special_tokens")):
            f.unlink()
    for f in qwen3_tokenizer_dir().iterdir():
        shutil.copy(f, odd / f.name)
    with pytest.raises(Exception, match="embeddings") as refused:  # noqa: PT011
        with _app(api_settings, api_store, odd):
            pass
    assert str(odd) in str(refused.value) and "151669 tokens" in str(refused.value)
