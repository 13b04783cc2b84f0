"""``trajstore analytics``: the failure analytics views in the terminal, and the analyst role.

One subcommand per view of :data:`store.analytics.VIEWS` (``failures``, ``rollbacks``,
``tool-errors``, ``outcomes``, ``timelines``, ``negatives``, ``signatures``), each taking the
filters its view takes and ``--format table|json|csv``; and ``grant --role NAME``, which
creates a read-only role for analysts (:mod:`store.analyst_role`).

``--since`` / ``--until`` take an ISO 8601 time (without an offset it is UTC) or a duration
back from now such as ``90s``, ``30m``, ``24h`` or ``7d``.
"""

from __future__ import annotations

import datetime as dt
import enum
import inspect
import io
import json
import shutil
import sys
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from store import analytics, errors
from store.analytics import VIEWS, AnalyticsView, Filters, query, row_as_dict
from store.settings import get_settings

__all__ = ["OutputFormat", "format_cell", "parse_time", "register", "render"]


class OutputFormat(enum.StrEnum):
    table = "table"
    json = "json"
    csv = "csv"


def parse_time(text: str, *, option: str, now: dt.datetime | None = None) -> dt.datetime:
    """``text`` as a timezone-aware time (:func:`store.analytics.parse_time`). Raises
    ``typer.BadParameter`` naming ``option`` and the text otherwise."""
    try:
        return analytics.parse_time(text, now=now)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=option) from None


def format_cell(value: Any) -> str:
    """How a value shows in the table: empty for None, floats with at most 4 decimals,
    times to the second, everything else as ``str``."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        text = f"{value:.4f}".rstrip("0").rstrip(".")
        return "0" if text in ("-0", "") else text
    if isinstance(value, dt.datetime):
        return value.isoformat(timespec="seconds")
    return str(value)


def _plain(value: Any) -> Any:
    return value.isoformat() if isinstance(value, dt.datetime) else value


def render(spec: AnalyticsView, rows: Sequence[Any], output: OutputFormat, *,
           width: int | None = None) -> str:
    """``rows`` of ``spec`` as text: a table, a JSON array of objects (every value exact,
    times in ISO 8601) or CSV with a header (None as an empty field). The table is as wide
    as its widest cells; when that is wider than ``width`` (a terminal's), each row is
    printed as a block of ``column | value`` lines instead, as psql's expanded display does.
    Raises ValueError for an unknown format and for ``width`` < 40."""
    if width is not None and width < 40:
        raise ValueError(f"width must be at least 40, got {width}")
    output = OutputFormat(output)
    columns = spec.columns
    if output is OutputFormat.json:
        return json.dumps([{k: _plain(v) for k, v in row_as_dict(r).items()} for r in rows],
                          indent=2) + "\n"
    if output is OutputFormat.csv:
        return analytics.rows_as_csv(spec, list(rows))
    cells = [[format_cell(v) for v in row_as_dict(r).values()] for r in rows]
    title = f"{spec.view} ({len(rows)} {'row' if len(rows) == 1 else 'rows'})"
    full = max(40, sum(max([len(c), *(len(line[i]) for line in cells)]) + 3
                       for i, c in enumerate(columns)) + 1)
    if width is not None and full > width:
        name_width = max(len(c) for c in columns)
        blocks = [title]
        for number, line in enumerate(cells, start=1):
            blocks.append(f"-[ row {number} ]".ljust(min(width, 40), "-"))
            blocks += [f"{c.ljust(name_width)} | {v}" for c, v in zip(columns, line,
                                                                      strict=True)]
        return "\n".join(blocks) + "\n"
    table = Table(*columns, title=title, title_justify="left")
    for line in cells:
        table.add_row(*line)
    buffer = io.StringIO()
    Console(file=buffer, width=full, no_color=True, highlight=False).print(table)
    return buffer.getvalue()


def _open_store() -> Any:
    from trajstore.store_access import open_store

    return open_store(get_settings())


# The options each filter gets, by Filters field (a view's subcommand has those it takes).
_FILTER_OPTIONS: dict[str, tuple[Any, Any]] = {
    "run_id": (Annotated[str | None, typer.Option("--run", help="Run id.")], None),
    "min_version": (Annotated[int | None, typer.Option(
        "--min-version", min=0, help="Lowest policy version (inclusive).")], None),
    "max_version": (Annotated[int | None, typer.Option(
        "--max-version", min=0, help="Highest policy version (inclusive).")], None),
    "since": (Annotated[str | None, typer.Option(
        "--since", help="Episodes finished at or after: ISO time or 30m, 24h, 7d ago.")], None),
    "until": (Annotated[str | None, typer.Option(
        "--until", help="Episodes finished before: ISO time or a duration ago.")], None),
    "tool": (Annotated[str | None, typer.Option("--tool", help="Tool name.")], None),
    "error_type": (Annotated[str | None, typer.Option(
        "--error-type", help="Error type, e.g. TypeError.")], None),
}
_COMMON_OPTIONS: dict[str, tuple[Any, Any]] = {
    "output": (Annotated[OutputFormat, typer.Option(
        "--format", case_sensitive=False, help="table, json or csv.")], OutputFormat.table),
    "limit": (Annotated[int | None, typer.Option("--limit", min=1, help="At most this many "
                                                 "rows.")], None),
}


def _show(spec: AnalyticsView, options: dict[str, Any]) -> None:
    values = {name: options.get(name) for name in spec.filters}
    for name, option in (("since", "--since"), ("until", "--until")):
        text = values.get(name)
        if text is not None:
            values[name] = parse_time(text, option=option)
    try:
        filters = Filters(**values)
    except (TypeError, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from None
    store = _open_store()
    try:
        if filters.run_id is not None:
            # An unknown run is a typo, not an empty answer.
            store.get_run(filters.run_id)
        rows = query(store.db, spec, filters, limit=options["limit"])
    except errors.StoreError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    finally:
        store.close()
    # A terminal gets a table that fits it; piped output is never wrapped.
    width = shutil.get_terminal_size().columns if sys.stdout.isatty() else None
    typer.echo(render(spec, rows, options["output"], width=width and max(width, 40)),
               nl=False)


def _view_command(spec: AnalyticsView) -> Callable[..., None]:
    """The subcommand of one view. Its signature is built from the view's filters, so that
    each subcommand offers exactly the options its view takes."""

    def command(**options: Any) -> None:
        _show(spec, options)

    chosen = [name for name in _FILTER_OPTIONS if name in spec.filters]
    parameters = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                          default=default)
        for name, (annotation, default) in [*((n, _FILTER_OPTIONS[n]) for n in chosen),
                                            *_COMMON_OPTIONS.items()]
    ]
    command.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    command.__doc__ = f"{spec.summary} (view {spec.view})"
    command.__name__ = spec.name.replace("-", "_")
    return command


def _grant(
    role: Annotated[str, typer.Option("--role", help="Name of the role to create or grant.")],
    login: Annotated[bool, typer.Option("--login/--no-login", help="Whether the role can log "
                                        "in (default: NOLOGIN, for use with SET ROLE or "
                                        "GRANT role TO user).")] = False,
    password_stdin: Annotated[bool, typer.Option(
        "--password-stdin", help="Read the LOGIN role's password from standard input.")]
    = False,
) -> None:
    """Create a read-only analyst role: it reads views and projections, writes nothing.

    The role may SELECT the analytics views and the projection tables, not the event log;
    every write (events included) is refused by its privileges.
    """
    from store.analyst_role import grant_read_only

    password = None
    if password_stdin:
        if not login:
            raise typer.BadParameter("--password-stdin needs --login", param_hint="--login")
        password = sys.stdin.readline().rstrip("\r\n")
    from store import preflight
    from store.db import Database

    # Creating a role takes the owner (the embedded server's owner, not the app role).
    db = Database(preflight.owner_database_url(get_settings()), max_size=1)
    try:
        done = grant_read_only(db, role=role, login=login, password=password)
    except (TypeError, ValueError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--role") from None
    except errors.StoreError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    finally:
        db.close()
    typer.echo(f"{'created' if done.created else 'updated'} role {done.role} "
               f"({'LOGIN' if done.login else 'NOLOGIN'}, read-only); it can read: "
               f"{', '.join(done.relations)}")


def register(app: typer.Typer) -> None:
    """Add the ``analytics`` command group to ``app``."""
    analytics = typer.Typer(name="analytics", no_args_is_help=True,
                            help="Failure analytics: where and why episodes fail, and "
                            "whether rollback helps.")
    for spec in VIEWS.values():
        analytics.command(spec.name)(_view_command(spec))
    analytics.command("grant")(_grant)
    app.add_typer(analytics, name="analytics")
