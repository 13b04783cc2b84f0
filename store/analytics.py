"""Failure analytics: the SQL views of migration 0005, queried with filters.

Every view (``failure_patterns``, ``rollback_outcomes``, ``tool_error_rates``,
``episode_outcomes``, ``timeline_stats``, ``negative_sample_stats``, ``error_signatures``) is
backed by an SQL function ``analytics_<view>`` taking the same filters as :class:`Filters`;
the view is that function with no filter. :data:`VIEWS` lists them under the short names the
command line and the REST routes use (``failures``, ``rollbacks``, ...), with the filters each
one accepts, so callers never branch on a view's name.

Filters: a run, a policy version range (inclusive), a time window on the episodes'
``finished_at`` (``since`` inclusive, ``until`` exclusive), a tool and an error type. Versions
are the version each view groups by (the failure's, the tool call's, the episode's or the
sample's).
"""

from __future__ import annotations

import csv
import dataclasses
import datetime as dt
import io
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from psycopg import sql

from store.analytics_rows import (
    EpisodeOutcome,
    ErrorSignatureCount,
    FailurePattern,
    NegativeSampleStat,
    RollbackOutcome,
    TimelineStat,
    ToolErrorRate,
)
from store.db import Database

__all__ = [
    "csv_cell",
    "AnalyticsView",
    "Filters",
    "VIEWS",
    "PROJECTION_TABLES",
    "parse_time",
    "query",
    "view_named",
    "row_as_dict",
    "rows_as_csv",
    "failure_patterns",
    "rollback_outcomes",
    "tool_error_rates",
    "episode_outcomes",
    "timeline_stats",
    "negative_sample_stats",
    "error_signatures",
    "EpisodeOutcome",
    "ErrorSignatureCount",
    "FailurePattern",
    "NegativeSampleStat",
    "RollbackOutcome",
    "TimelineStat",
    "ToolErrorRate",
]

#: Tables the views read: what an analyst role may read besides the views.
PROJECTION_TABLES = ("runs", "episodes", "samples", "timeline_forks", "failures", "tool_calls")

#: Filter field -> argument name of the SQL functions.
_ARGUMENTS = {
    "run_id": "run",
    "min_version": "min_version",
    "max_version": "max_version",
    "since": "since",
    "until": "until",
    "tool": "tool",
    "error_type": "error_kind",
}


def parse_time(text: str, *, now: dt.datetime | None = None) -> dt.datetime:
    """``text`` as a timezone-aware time for ``since``/``until``: an ISO 8601 time (UTC when
    it has no offset), or a duration back from ``now`` as ``pytimeparse`` reads one (``90s``,
    ``30m``, ``24h``, ``7d``, ``1h30m``, ``2 days``; a bare number is no duration). Raises
    ValueError quoting the text otherwise, for a negative duration, and for one reaching
    back before the year 1."""
    from pytimeparse import parse as parse_duration

    now = now or dt.datetime.now(dt.UTC)
    stripped = text.strip()
    try:
        value = dt.datetime.fromisoformat(stripped)
    except ValueError:
        value = None
    if value is not None:
        return value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)
    seconds = None if re.fullmatch(r"[\d.:]+", stripped) else parse_duration(stripped)
    if seconds is None:
        raise ValueError(f"{text!r} is not an ISO 8601 time nor a duration such as 30m, 24h "
                         "or 7d")
    if seconds < 0:
        raise ValueError(f"{text!r} is a negative duration: give how long back from now")
    try:
        return now - dt.timedelta(seconds=seconds)
    except (OverflowError, ValueError):
        raise ValueError(f"{text!r} reaches back before the year 1") from None


def _check_name(field: str, value: object) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise TypeError(f"{field} must be a str, got {type(value).__name__}")
    if not value.strip():
        raise ValueError(f"{field} must not be empty, got {value!r}")
    if "\x00" in value:
        raise ValueError(f"{field} must not contain a NUL character")


def _check_version(field: str, value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{field} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{field} must be >= 0, got {value}")
    if value > 2**31 - 1:
        raise ValueError(f"{field} must be at most {2**31 - 1} (policy versions are 32-bit)")


def _check_time(field: str, value: object) -> None:
    if value is None:
        return
    if not isinstance(value, dt.datetime):
        raise TypeError(f"{field} must be a datetime, got {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{field} must be timezone-aware, got {value.isoformat()}")


@dataclass(frozen=True)
class Filters:
    """What an analytics query is narrowed to; None leaves a filter off.

    Raises TypeError for a value of the wrong type and ValueError naming the field for an
    empty name, a negative version, ``min_version > max_version``, a naive datetime or
    ``since >= until``.
    """

    run_id: str | None = None
    min_version: int | None = None
    max_version: int | None = None
    since: dt.datetime | None = None
    until: dt.datetime | None = None
    tool: str | None = None
    error_type: str | None = None

    def __post_init__(self) -> None:
        for name in ("run_id", "tool", "error_type"):
            _check_name(name, getattr(self, name))
        for name in ("min_version", "max_version"):
            _check_version(name, getattr(self, name))
        for name in ("since", "until"):
            _check_time(name, getattr(self, name))
        if (self.min_version is not None and self.max_version is not None
                and self.min_version > self.max_version):
            raise ValueError(f"min_version ({self.min_version}) must not exceed max_version "
                             f"({self.max_version})")
        if self.since is not None and self.until is not None and self.since >= self.until:
            raise ValueError(f"since ({self.since.isoformat()}) must be before until "
                             f"({self.until.isoformat()})")

    def given(self) -> frozenset[str]:
        """Names of the filters that are set."""
        return frozenset(f.name for f in fields(self) if getattr(self, f.name) is not None)


_ALL = frozenset(_ARGUMENTS)
_NO_TOOL = _ALL - {"tool", "error_type"}


@dataclass(frozen=True)
class AnalyticsView:
    """One analytics view: its short ``name`` (command line, REST), SQL ``view`` and
    ``function``, the dataclass of its rows, the filters it accepts and its row order."""

    name: str
    view: str
    function: str
    row: type
    filters: frozenset[str]
    order_by: tuple[str, ...]
    summary: str

    @property
    def columns(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self.row))


def _view(name: str, view: str, row: type, filters: frozenset[str], order_by: tuple[str, ...],
          summary: str) -> AnalyticsView:
    return AnalyticsView(name=name, view=view, function=f"analytics_{view}", row=row,
                         filters=filters, order_by=order_by, summary=summary)


#: The views by short name, in the order they are documented.
VIEWS: Mapping[str, AnalyticsView] = {
    v.name: v
    for v in (
        _view("failures", "failure_patterns", FailurePattern, _ALL,
              ("run_id", "policy_version", "failures DESC", "tool_name", "error_type",
               "position_key"),
              "Tool errors by run, policy version, tool, error type and position."),
        _view("rollbacks", "rollback_outcomes", RollbackOutcome, _NO_TOOL,
              ("run_id", "policy_version"),
              "Rollbacks, successful retries and rewards with and without rollback."),
        _view("tool-errors", "tool_error_rates", ToolErrorRate, _ALL - {"error_type"},
              ("run_id", "policy_version", "tool_name"),
              "Calls, errors and error rate of each tool."),
        _view("outcomes", "episode_outcomes", EpisodeOutcome, _NO_TOOL,
              ("run_id", "policy_version", "group_id", "status"),
              "Episode status, reward and length by group and policy version."),
        _view("timelines", "timeline_stats", TimelineStat, _NO_TOOL,
              ("run_id", "policy_version"),
              "Timeline merging: timelines before and after, forks by reason, drift."),
        _view("negatives", "negative_sample_stats", NegativeSampleStat, _NO_TOOL,
              ("run_id", "policy_version"),
              "Negative samples against positives, with their lease state."),
        _view("signatures", "error_signatures", ErrorSignatureCount, _ALL,
              ("run_id", "failures DESC", "tool_name", "error_type", "error_signature"),
              "Tool errors grouped by normalised message."),
    )
}


def view_named(name: str) -> AnalyticsView:
    """The view registered as ``name`` (short name such as ``failures``, or the SQL view name
    such as ``failure_patterns``). Raises ValueError listing the known names otherwise."""
    if name in VIEWS:
        return VIEWS[name]
    for v in VIEWS.values():
        if v.view == name:
            return v
    raise ValueError(f"unknown analytics view {name!r}; known: {', '.join(VIEWS)}")


def _order_term(term: str) -> sql.Composable:
    column, _, direction = term.partition(" ")
    return sql.SQL("{} {} NULLS LAST").format(sql.Identifier(column),
                                              sql.SQL(direction or "ASC"))


def query(
    db: Database,
    view: str | AnalyticsView,
    filters: Filters | None = None,
    *,
    limit: int | None = None,
) -> list[Any]:
    """Rows of ``view`` (a name as :func:`view_named` takes it, or an entry of
    :data:`VIEWS`) narrowed by ``filters``, in the view's order, as its row dataclass.

    Raises ValueError for an unknown view, for a filter the view does not take (naming both)
    and for ``limit`` < 1; TypeError for ``filters`` that is not a :class:`Filters` and a
    non-int ``limit``. Database errors are ``store.errors`` (a store not migrated to 0005
    gives a ``StoreError`` naming the missing function).
    """
    spec = view if isinstance(view, AnalyticsView) else view_named(view)
    if filters is None:
        filters = Filters()
    if not isinstance(filters, Filters):
        raise TypeError(f"filters must be a Filters, got {type(filters).__name__}")
    unsupported = sorted(filters.given() - spec.filters)
    if unsupported:
        raise ValueError(f"view {spec.name!r} does not take the filter(s) "
                         f"{', '.join(unsupported)}; it takes {', '.join(sorted(spec.filters))}")
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise TypeError(f"limit must be an int, got {type(limit).__name__}")
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
    given = sorted(filters.given())
    statement = sql.SQL("SELECT {columns} FROM {function}({arguments}) ORDER BY {order}").format(
        columns=sql.SQL(", ").join(sql.Identifier(c) for c in spec.columns),
        function=sql.Identifier(spec.function),
        arguments=sql.SQL(", ").join(
            sql.SQL("{} => {}").format(sql.Identifier(_ARGUMENTS[name]),
                                       sql.Placeholder(name))
            for name in given),
        order=sql.SQL(", ").join(_order_term(t) for t in spec.order_by),
    )
    if limit is not None:
        statement = sql.SQL("{} LIMIT {}").format(statement, sql.Literal(limit))
    params = {name: getattr(filters, name) for name in given}
    with db.connection() as conn:
        # Not prepared: a generic plan could not fold the NULL filters away.
        records = conn.execute(statement, params, prepare=False).fetchall()
    return [spec.row(*record) for record in records]


def row_as_dict(row: Any) -> dict[str, Any]:
    """A view row as a plain dict (column -> value). Raises TypeError for anything that is
    not a row dataclass."""
    if not dataclasses.is_dataclass(row) or isinstance(row, type):
        raise TypeError(f"expected an analytics row, got {type(row).__name__}")
    return {f.name: getattr(row, f.name) for f in fields(row)}


_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(value: Any) -> Any:
    """A value as a CSV cell: None empty, times in ISO 8601, and text that a spreadsheet
    would run as a formula (starting with = + - @, a tab or a carriage return: an error type
    or a tool name comes from the agent, so from whoever controls its input) prefixed with
    ``'``, which spreadsheets show as text. Numbers are left as they are."""
    if value is None:
        return ""
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, str) and value.startswith(_FORMULA_START):
        return "'" + value
    return value


def rows_as_csv(spec: AnalyticsView, rows: list[Any]) -> str:
    """``rows`` of ``spec`` as CSV with a header row, each value through ``csv_cell``.
    Raises TypeError for a row that is not a row dataclass."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(spec.columns)
    for r in rows:
        writer.writerow([csv_cell(v) for v in row_as_dict(r).values()])
    return buffer.getvalue()


def failure_patterns(db: Database, filters: Filters | None = None, *,
                     limit: int | None = None) -> list[FailurePattern]:
    """Rows of ``failure_patterns``; every filter applies. Bad input as :func:`query`."""
    return query(db, VIEWS["failures"], filters, limit=limit)


def rollback_outcomes(db: Database, filters: Filters | None = None, *,
                      limit: int | None = None) -> list[RollbackOutcome]:
    """Rows of ``rollback_outcomes``; no tool or error type filter (ValueError). Bad input
    as :func:`query`."""
    return query(db, VIEWS["rollbacks"], filters, limit=limit)


def tool_error_rates(db: Database, filters: Filters | None = None, *,
                     limit: int | None = None) -> list[ToolErrorRate]:
    """Rows of ``tool_error_rates``; no error type filter (ValueError). Bad input as
    :func:`query`."""
    return query(db, VIEWS["tool-errors"], filters, limit=limit)


def episode_outcomes(db: Database, filters: Filters | None = None, *,
                     limit: int | None = None) -> list[EpisodeOutcome]:
    """Rows of ``episode_outcomes``; no tool or error type filter (ValueError). Bad input as
    :func:`query`."""
    return query(db, VIEWS["outcomes"], filters, limit=limit)


def timeline_stats(db: Database, filters: Filters | None = None, *,
                   limit: int | None = None) -> list[TimelineStat]:
    """Rows of ``timeline_stats``; no tool or error type filter (ValueError). Bad input as
    :func:`query`."""
    return query(db, VIEWS["timelines"], filters, limit=limit)


def negative_sample_stats(db: Database, filters: Filters | None = None, *,
                          limit: int | None = None) -> list[NegativeSampleStat]:
    """Rows of ``negative_sample_stats``; no tool or error type filter (ValueError). Bad
    input as :func:`query`."""
    return query(db, VIEWS["negatives"], filters, limit=limit)


def error_signatures(db: Database, filters: Filters | None = None, *,
                     limit: int | None = None) -> list[ErrorSignatureCount]:
    """Rows of ``error_signatures``; every filter applies. Bad input as :func:`query`."""
    return query(db, VIEWS["signatures"], filters, limit=limit)
