"""``trajstore analytics``: table, JSON and CSV output agree with the SQL views; filters,
time parsing, the grant command and bad input."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import typer
from typer.testing import CliRunner

from store import analytics
from store.analytics import Filters
from store.settings import get_settings
from tests.analytics.conftest import RUN, Seeded
from trajstore.analytics_cli import OutputFormat, format_cell, parse_time, register, render


@pytest.fixture
def cli(seeded: Seeded, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Iterator[Any]:
    """Runs ``trajstore analytics ...`` in this process against the seeded store."""
    app = typer.Typer()
    register(app)

    @app.callback()
    def main() -> None:
        """The trajstore command line, with only the analytics group."""

    monkeypatch.setenv("TRAJSTORE_DATABASE_URL", seeded.url)
    monkeypatch.setenv("TRAJSTORE_DATA_DIR", str(tmp_path))
    get_settings.cache_clear()
    runner = CliRunner()

    def invoke(*args: str, stdin: str | None = None) -> Any:
        return runner.invoke(app, ["analytics", *args], input=stdin)

    yield invoke
    get_settings.cache_clear()


def table_lines(output: str) -> list[list[str]]:
    """The header and body rows of a rich table: cells between the vertical bars."""
    rows = []
    for line in output.splitlines():
        for bar in ("┃", "│"):
            if line.startswith(bar):
                rows.append([cell.strip() for cell in line.strip(bar).split(bar)])
    return rows


@pytest.mark.parametrize("name", list(analytics.VIEWS))
def test_every_format_agrees_with_sql(cli: Any, seeded: Seeded, name: str) -> None:
    spec = analytics.VIEWS[name]
    rows = analytics.query(seeded.db, spec, Filters(run_id=RUN))
    assert rows
    plain = [analytics.row_as_dict(r) for r in rows]

    result = cli(name, "--run", RUN, "--format", "json")
    assert result.exit_code == 0, result.output
    decoded = json.loads(result.output)
    for row in plain:
        for key, value in row.items():
            if isinstance(value, dt.datetime):
                row[key] = value.isoformat()
    assert decoded == plain

    result = cli(name, "--run", RUN, "--format", "csv")
    assert result.exit_code == 0, result.output
    read = list(csv.DictReader(io.StringIO(result.output)))
    assert [list(r) for r in read] == [list(spec.columns)] * len(rows)
    for got, want in zip(read, plain, strict=True):
        for key, value in want.items():
            if value is None:
                assert got[key] == ""
            elif isinstance(value, float):
                assert float(got[key]) == value
            else:
                assert got[key] == str(value)

    result = cli(name, "--run", RUN)
    assert result.exit_code == 0, result.output
    header, *body = table_lines(result.output)
    assert header == list(spec.columns)
    assert body == [[format_cell(v) for v in analytics.row_as_dict(r).values()] for r in rows]
    assert f"{spec.view} ({len(rows)} rows)" in result.output


def test_table_shows_the_failure_numbers(cli: Any) -> None:
    result = cli("failures", "--run", RUN, "--tool", "search", "--max-version", "0")
    assert result.exit_code == 0, result.output
    (row,) = table_lines(result.output)[1:]
    assert row == ["run-analytics", "0", "search", "TypeError", "turn_1", "3", "2", "6", "0.5",
                   "3", "1", "1.3333", "0"]


def test_filters_reach_the_query(cli: Any, seeded: Seeded) -> None:
    since = seeded.boundary.isoformat()
    result = cli("rollbacks", "--run", RUN, "--since", since, "--format", "json")
    assert result.exit_code == 0, result.output
    assert [r["policy_version"] for r in json.loads(result.output)] == [1]
    result = cli("signatures", "--run", RUN, "--error-type", "NameError", "--format", "json")
    assert [r["failures"] for r in json.loads(result.output)] == [4]
    result = cli("outcomes", "--run", RUN, "--until", since, "--limit", "1", "--format", "json")
    assert [(r["group_id"], r["status"]) for r in json.loads(result.output)] == [
        ("g1", "completed")]
    result = cli("timelines", "--run", RUN, "--since", "1d", "--format", "json")
    assert [r["policy_version"] for r in json.loads(result.output)] == [0, 1]
    # An unknown run is a typo to report, not an empty table.
    result = cli("negatives", "--run", "no-such-run")
    assert result.exit_code == 1 and "no run 'no-such-run'" in result.output


@pytest.mark.parametrize(("args", "message"), [
    (["rollbacks", "--tool", "search"], "No such option"),
    (["tool-errors", "--error-type", "TypeError"], "No such option"),
    (["failures", "--since", "yesterday"], "'yesterday' is not an ISO 8601 time"),
    (["failures", "--min-version", "3", "--max-version", "1"], "must not exceed max_version"),
    (["failures", "--min-version", "-1"], "--min-version"),
    (["failures", "--format", "xml"], "xml"),
    (["failures", "--limit", "0"], "--limit"),
    (["grant", "--role", "1bad"], "role must be 1-63 letters"),
    (["grant", "--role", "someone", "--password-stdin"], "--password-stdin needs --login"),
])
def test_bad_input_is_named(cli: Any, args: list[str], message: str) -> None:
    result = cli(*args)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_unmigrated_database_is_an_error(fresh_db: str, monkeypatch: pytest.MonkeyPatch,
                                         tmp_path: Any) -> None:
    app = typer.Typer()
    register(app)
    app.callback()(lambda: None)
    monkeypatch.setenv("TRAJSTORE_DATABASE_URL", fresh_db)
    monkeypatch.setenv("TRAJSTORE_DATA_DIR", str(tmp_path))
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(app, ["analytics", "failures"])
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 1
    assert "trajstore migrate" in result.output


def test_grant_command_creates_a_read_only_login_role(cli: Any, seeded: Seeded) -> None:
    role = f"analyst_{uuid.uuid4().hex[:8]}"
    try:
        result = cli("grant", "--role", role, "--login", "--password-stdin", stdin="pw-1\n")
        assert result.exit_code == 0, result.output
        assert f"created role {role} (LOGIN, read-only)" in result.output
        assert "failure_patterns" in result.output
        params = psycopg.conninfo.conninfo_to_dict(seeded.url)
        params.update(user=role, password="pw-1")
        with psycopg.connect(**params, autocommit=True) as conn:  # type: ignore[arg-type]
            assert conn.execute("SELECT count(*) FROM failure_patterns").fetchone()[0] == 5
            conn.execute("SET default_transaction_read_only = off")
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("DELETE FROM episodes")
        result = cli("grant", "--role", role)
        assert result.exit_code == 0 and f"updated role {role}" in result.output
        result = cli("grant", "--role", "postgres")
        assert result.exit_code == 1 and "can write" in result.output
    finally:
        with psycopg.connect(seeded.url, autocommit=True) as conn:
            conn.execute(f'DROP OWNED BY "{role}"')
            conn.execute(f'DROP ROLE IF EXISTS "{role}"')


def test_a_real_process_prints_the_same_json(seeded: Seeded, tmp_path: Any) -> None:
    launcher = ("import typer; from trajstore.analytics_cli import register; "
                "app = typer.Typer(); register(app); app.callback()(lambda: None); app()")
    env = {"TRAJSTORE_DATABASE_URL": seeded.url, "TRAJSTORE_DATA_DIR": str(tmp_path),
           "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", launcher, "analytics", "tool-errors", "--run",
                           RUN, "--format", "json"], capture_output=True, text=True, env=env,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    want = [analytics.row_as_dict(r)
            for r in analytics.tool_error_rates(seeded.db, Filters(run_id=RUN))]
    assert json.loads(done.stdout) == want


def test_parse_time() -> None:
    now = dt.datetime(2026, 5, 1, 12, 0, tzinfo=dt.UTC)
    assert parse_time("24h", option="--since", now=now) == now - dt.timedelta(hours=24)
    assert parse_time("90s", option="--since", now=now) == now - dt.timedelta(seconds=90)
    assert parse_time("7d", option="--since", now=now) == now - dt.timedelta(days=7)
    assert parse_time("30m", option="--since", now=now) == now - dt.timedelta(minutes=30)
    assert parse_time("2026-04-30", option="--until") == dt.datetime(2026, 4, 30, tzinfo=dt.UTC)
    offset = parse_time("2026-04-30T10:00:00+02:00", option="--until")
    assert offset == dt.datetime(2026, 4, 30, 8, 0, tzinfo=dt.UTC)
    assert parse_time("1h30m", option="--since", now=now) == now - dt.timedelta(minutes=90)
    assert parse_time("5 hours", option="--since", now=now) == now - dt.timedelta(hours=5)
    for bad in ("5", "soon", "12:30"):
        with pytest.raises(typer.BadParameter, match=f"'{bad}' is not an ISO 8601 time"):
            parse_time(bad, option="--since")
    with pytest.raises(typer.BadParameter, match="negative duration"):
        parse_time("-5m", option="--since")
    with pytest.raises(typer.BadParameter, match="before the year 1"):
        parse_time("999999999d", option="--since", now=now)


def test_format_cell() -> None:
    assert [format_cell(v) for v in (None, 3, 0.5, 1 / 3, 2.0, -0.00001, "x", True)] == [
        "", "3", "0.5", "0.3333", "2", "0", "x", "yes"]
    when = dt.datetime(2026, 5, 1, 12, 0, 7, 123456, tzinfo=dt.UTC)
    assert format_cell(when) == "2026-05-01T12:00:07+00:00"


def test_render_fits_a_terminal_and_refuses_bad_arguments(seeded: Seeded) -> None:
    spec = analytics.VIEWS["failures"]
    rows = analytics.failure_patterns(seeded.db, Filters(run_id=RUN))
    narrow = render(spec, rows, OutputFormat.table, width=80)
    # Too wide for 80 columns: one block of "column | value" lines per row.
    blocks = narrow.split("-[ row ")[1:]
    assert len(blocks) == len(rows)
    first = dict(line.split(" | ") for line in blocks[0].splitlines()[1:])
    assert {k.strip(): v for k, v in first.items()} == {
        k: format_cell(v) for k, v in analytics.row_as_dict(rows[0]).items()}
    assert max(len(line) for line in narrow.splitlines()) <= 80
    wide = render(spec, rows, OutputFormat.table)
    assert len(table_lines(wide)) == len(rows) + 1
    assert render(spec, rows, OutputFormat.table, width=10_000) == wide
    with pytest.raises(ValueError, match="width must be at least 40, got 10"):
        render(spec, rows, OutputFormat.table, width=10)
    with pytest.raises(ValueError, match="xml"):
        render(spec, rows, "xml")  # type: ignore[arg-type]
