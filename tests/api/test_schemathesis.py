"""Property-based tests over the OpenAPI document (schemathesis): whatever a client sends,
valid or not, no route answers with a server error, and every error is the JSON error body.
The app runs on the test database with the tiny model as its in-process engine."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from api.app import create_app
from api.keys import KeyStore
from store.db import Database
from store.eventlog import EventStore
from store.events import EpisodeStarted
from store.settings import Settings
from tests.api.conftest import make_project
from tests.api.episodes import create_run

pytestmark = pytest.mark.timeout(900)

_STATE: dict[str, Any] = {}


def _app() -> Any:
    """The app, built once per process from the session's database (schemathesis keeps the
    app's lifespan running for the rest of the process)."""
    return _STATE["app"]


@pytest.fixture(scope="module", autouse=True)
def fuzzed_app(pg_url: str, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
               ) -> Any:
    s = Settings(database_url=pg_url, data_dir=tmp_path_factory.mktemp("fuzz"),
                 api_key_scrypt_n=1024, gateway_engine_model=str(tiny_model_dir),
                 gateway_max_tokens=4, api_max_request_bytes=256 * 1024)
    store = EventStore(Database(pg_url, max_size=4), s)
    project = make_project(KeyStore(store.db, s))
    run_id = f"fuzz-{uuid.uuid4().hex[:6]}"
    create_run(store, run_id, project=project.name, group_size=1)
    episode_id = f"fuzz-ep-{uuid.uuid4().hex[:6]}"
    store.append(episode_id, [EpisodeStarted(run_id=run_id, group_id="g0")], "no_stream")
    _STATE.update(app=create_app(s, store=store), project=project, run_id=run_id,
                  episode_id=episode_id)
    _STATE["schema"] = schemathesis.openapi.from_asgi("/openapi.json", _STATE["app"])
    return _STATE["app"]


schema = schemathesis.pytest.from_fixture("fuzz_schema")


@pytest.fixture(scope="module")
def fuzz_schema(fuzzed_app: Any) -> Any:
    return _STATE["schema"]


@schema.parametrize()
@settings(max_examples=8, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_route_answers_with_a_server_error(case: Any) -> None:
    project = _STATE["project"]
    # Half the cases name the real run and episode, so that generated bodies reach the
    # store's validation instead of stopping at a 404.
    params = case.path_parameters or {}
    if params and sum(map(ord, str(sorted(params.items())))) % 2 == 0:
        for name, value in (("run_id", _STATE["run_id"]), ("episode_id", _STATE["episode_id"])):
            if name in params:
                params[name] = value
    response = case.call(headers={"Authorization": f"Bearer {project.admin}"})
    assert response.status_code < 500, (case.method, case.path, response.text[:500])
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"} and {"code", "message"} <= set(body["error"]), body
