"""``GET /v1/runs/{run}/analytics/<view>``: every view's rows agree with SQL and with
``trajstore analytics``; filters reach the query; bad input is a 422 naming it; keys and
projects are checked."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from api.app import create_app
from api.keys import KeyStore
from store import analytics
from store.analytics import Filters
from store.settings import Settings, get_settings
from tests.analytics.conftest import OTHER, RUN, Seeded
from trajstore.analytics_cli import register


def _plain(row: Any) -> dict[str, Any]:
    return {k: v.isoformat() if isinstance(v, dt.datetime) else v
            for k, v in analytics.row_as_dict(row).items()}


def _times(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with ISO 8601 times parsed, so ``Z`` and ``+00:00`` compare equal."""
    def value(v: Any) -> Any:
        if isinstance(v, str) and len(v) >= 20 and v[4] == "-" and v[10] == "T":
            return dt.datetime.fromisoformat(v)
        return v

    return [{k: value(v) for k, v in r.items()} for r in rows]


@pytest.fixture(scope="module")
def rest(seeded: Seeded, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[tuple[TestClient, dict[str, dict[str, str]]]]:
    settings = Settings(database_url=seeded.url, data_dir=Path(tmp_path_factory.mktemp("rest")),
                        api_key_scrypt_n=1024)
    keys = KeyStore(seeded.db, settings)
    headers = {
        name: {"Authorization": f"Bearer {keys.create(project=project, role=role).token}"}
        for name, project, role in (("read", "default", "read"),
                                    ("ingest", "default", "ingest"),
                                    ("stranger", "elsewhere", "read"))
    }
    keys.close()
    with TestClient(create_app(settings, store=seeded.store)) as client:
        yield client, headers


@pytest.fixture
def get(rest: tuple[TestClient, dict[str, dict[str, str]]]) -> Any:
    client, headers = rest

    def call(path: str, key: str = "read", **params: Any) -> Any:
        return client.get(path, params=params, headers=headers[key])

    return call


@pytest.mark.parametrize("name", list(analytics.VIEWS))
def test_every_view_agrees_with_sql_and_the_cli(get: Any, seeded: Seeded, name: str,
                                                monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    spec = analytics.VIEWS[name]
    rows = analytics.query(seeded.db, spec, Filters(run_id=RUN))
    assert rows
    response = get(f"/v1/runs/{RUN}/analytics/{name}")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["view"] == spec.view and body["run_id"] == RUN
    assert body["columns"] == list(spec.columns)
    assert _times(body["rows"]) == _times([_plain(r) for r in rows])

    monkeypatch.setenv("TRAJSTORE_DATABASE_URL", seeded.url)
    monkeypatch.setenv("TRAJSTORE_DATA_DIR", str(tmp_path))
    get_settings.cache_clear()
    app = typer.Typer()
    register(app)

    @app.callback()
    def main() -> None:
        """Only the analytics group."""

    try:
        for fmt in ("json", "csv"):
            printed = CliRunner().invoke(app, ["analytics", name, "--run", RUN, "--format", fmt])
            assert printed.exit_code == 0, printed.output
            served = get(f"/v1/runs/{RUN}/analytics/{name}", format=fmt)
            assert served.status_code == 200
            if fmt == "json":
                assert _times(json.loads(printed.output)) == _times(served.json()["rows"])
            else:
                assert served.headers["content-type"].startswith("text/csv")
                assert served.text == printed.output
                assert len(list(csv.reader(io.StringIO(served.text)))) == len(rows) + 1
    finally:
        get_settings.cache_clear()


def test_the_failure_numbers_over_http(get: Any) -> None:
    body = get(f"/v1/runs/{RUN}/analytics/failures", tool="search", max_version=0).json()
    (row,) = body["rows"]
    assert body["filters"] == {"tool": "search", "max_version": 0}
    # e1 and e2 at version 0: three TypeErrors of search at turn_1, all recovered by retry.
    assert (row["error_type"], row["position_key"], row["failures"],
            row["episodes_affected"], row["recovered_by_retry"]) == ("TypeError", "turn_1", 3,
                                                                     2, 3)


@pytest.mark.parametrize("params,filters", [
    ({"tool": "calc"}, Filters(run_id=RUN, tool="calc")),
    ({"error_type": "NameError", "min_version": 0}, Filters(run_id=RUN, error_type="NameError",
                                                            min_version=0)),
    ({"min_version": 1, "max_version": 1}, Filters(run_id=RUN, min_version=1, max_version=1)),
])
def test_filters_reach_the_query(get: Any, seeded: Seeded, params: dict[str, Any],
                                 filters: Filters) -> None:
    want = [_plain(r) for r in analytics.query(seeded.db, "failures", filters)]
    assert want
    assert get(f"/v1/runs/{RUN}/analytics/failures", **params).json()["rows"] == want


def test_time_windows(get: Any, seeded: Seeded) -> None:
    boundary = seeded.boundary.isoformat()
    before = get(f"/v1/runs/{RUN}/analytics/outcomes", until=boundary).json()["rows"]
    after = get(f"/v1/runs/{RUN}/analytics/outcomes", since=boundary).json()["rows"]
    assert {r["policy_version"] for r in before} == {0}
    assert {r["policy_version"] for r in after} == {1}
    want = analytics.query(seeded.db, "outcomes", Filters(run_id=RUN, since=seeded.boundary))
    assert _times(after) == _times([_plain(r) for r in want])
    # A duration back from now covers everything seeded a moment ago.
    assert (get(f"/v1/runs/{RUN}/analytics/outcomes", since="7d").json()["rows"]
            == get(f"/v1/runs/{RUN}/analytics/outcomes").json()["rows"])
    assert get(f"/v1/runs/{RUN}/analytics/outcomes", until="7d").json()["rows"] == []


def test_limit_and_other_runs(get: Any, seeded: Seeded) -> None:
    rows = get(f"/v1/runs/{RUN}/analytics/signatures", limit=1).json()["rows"]
    assert len(rows) == 1
    other = get(f"/v1/runs/{OTHER}/analytics/outcomes").json()["rows"]
    assert {r["run_id"] for r in other} == {OTHER}


@pytest.mark.parametrize("view,params,status,named", [
    ("rollbacks", {"tool": "search"}, 422, "tool"),
    ("tool-errors", {"error_type": "TypeError"}, 422, "error_type"),
    ("failures", {"bogus": "1"}, 422, "bogus"),
    ("failures", {"since": "yesterday"}, 422, "since"),
    ("failures", {"min_version": 3, "max_version": 1}, 422, "min_version"),
    ("failures", {"min_version": -1}, 422, "min_version"),
    ("failures", {"limit": 0}, 422, "limit"),
    ("failures", {"format": "xml"}, 422, "format"),
    ("failures", {"since": "1h", "until": "2h"}, 422, "since"),
])
def test_bad_input_is_named(get: Any, view: str, params: dict[str, Any], status: int,
                            named: str) -> None:
    response = get(f"/v1/runs/{RUN}/analytics/{view}", **params)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert named in error["message"] or named in str(error.get("field")), error


def test_keys_and_projects(rest: tuple[TestClient, dict[str, dict[str, str]]],
                           get: Any) -> None:
    client, _ = rest
    assert client.get(f"/v1/runs/{RUN}/analytics/failures").status_code == 401
    assert get(f"/v1/runs/{RUN}/analytics/failures", key="ingest").status_code == 403
    assert get(f"/v1/runs/{RUN}/analytics/failures", key="stranger").status_code == 403
    assert get("/v1/runs/no-such-run/analytics/failures").status_code == 404
    assert get(f"/v1/runs/{RUN}/analytics/no-such-view").status_code == 404
