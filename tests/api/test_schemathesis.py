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


def test_stateful_links_never_answer_with_a_server_error(fuzzed_app: Any) -> None:
    """Sequences that follow the document's links (create a run, start an episode of it,
    append to it, read it back) with generated bodies: no step answers with a 5xx, and every
    error is the JSON error body."""
    project = _STATE["project"]
    workflow = _STATE["schema"].as_state_machine()

    class Workflow(workflow):  # type: ignore[misc, valid-type]
        def get_call_kwargs(self, case: Any) -> dict[str, Any]:
            return {"headers": {"Authorization": f"Bearer {project.admin}"}}

        def before_call(self, case: Any) -> None:
            # Fresh ids on every call: the same generated step must meet the same server
            # state on every run, or hypothesis sees the answers (201 vs 409) as flaky.
            body = case.body
            if isinstance(body, dict):
                for name in ("run_id", "episode_id", "event_id"):
                    if isinstance(body.get(name), str) and case.method.upper() == "POST":
                        body[name] = (f"sf-{uuid.uuid4().hex[:12]}" if name != "event_id"
                                      else str(uuid.uuid4()))
                for event in body.get("events") or []:
                    if isinstance(event, dict) and "event_id" in event:
                        event["event_id"] = str(uuid.uuid4())

        def validate_response(self, response: Any, case: Any, additional_checks: Any = None,
                              **kwargs: Any) -> None:
            assert response.status_code < 500, (case.method, case.path,
                                                 response.text[:500])
            if response.status_code >= 400:
                body = response.json()
                assert set(body) == {"error"}, body

    Workflow.run(settings=settings(max_examples=15, stateful_step_count=4, deadline=None,
                                   derandomize=True, database=None,
                                   suppress_health_check=list(HealthCheck)))
