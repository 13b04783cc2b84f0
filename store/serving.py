"""Which rollout engines serve which policy version of a run, and since when.

A training step appends ``policy_updated`` (version, checkpoint location) to the run's stream.
Each rollout engine that then takes that version (loading the checkpoint folder, receiving
the weights from a trainer in its own process, or through a server's weight-update route)
appends ``policy_served`` to the same stream (:func:`record_policy_served`): its stable id,
backend, the version, where the weights came from and how long loading them took. Both are
plain events of the log, so the take-up of every version can be rebuilt at any time
(:func:`policy_takeup`): when the version was recorded, which engines took it and when, and
the lag from ``policy_updated`` to each take-up. Both times are the database's recording
times (one clock, whatever the engines' clocks say).

Policy updates and engine reports share the run's stream. :func:`append_policy_updated`
appends a new version and retries past the engines' reports that land meanwhile (the
version check stays exact: two trainers never record one version).
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass

from psycopg.rows import dict_row

from store import errors
from store.db import scalar
from store.eventlog import AppendResult, EventStore, run_stream_id
from store.events import PolicyServed, PolicyUpdated
from store.rows import safe_data

__all__ = [
    "EngineTakeup",
    "VersionTakeup",
    "append_policy_updated",
    "newest_policy",
    "newest_policy_version",
    "policy_takeup",
    "record_policy_served",
]


@dataclass(frozen=True)
class EngineTakeup:
    """One engine's first report of one version. ``lag_seconds`` runs from the version's
    ``policy_updated`` to the report (None for version 0, the base weights, which no update
    recorded)."""

    engine: str
    backend: str
    served_at: dt.datetime
    lag_seconds: float | None
    load_seconds: float | None
    source: str | None


@dataclass(frozen=True)
class VersionTakeup:
    """One policy version of a run: its step, when it was recorded (None for version 0),
    its checkpoint, and the engines that took it, in the order they reported."""

    version: int
    step: int | None
    updated_at: dt.datetime | None
    checkpoint: str | None
    engines: tuple[EngineTakeup, ...]

    @property
    def lag_max_seconds(self) -> float | None:
        """The slowest engine's lag (None when no engine with a lag reported)."""
        lags = [e.lag_seconds for e in self.engines if e.lag_seconds is not None]
        return max(lags) if lags else None

    @property
    def lag_mean_seconds(self) -> float | None:
        """The engines' mean lag (None when no engine with a lag reported)."""
        lags = [e.lag_seconds for e in self.engines if e.lag_seconds is not None]
        return sum(lags) / len(lags) if lags else None


def _text(name: str, value: object, *, limit: int) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, got {type(value).__name__}")
    if not value.strip() or len(value) > limit:
        raise errors.ValidationError(f"{name} must be 1 to {limit} characters, not blank, "
                                     f"got {value!r:.80}", field=name)
    return value


def _run_exists(store: EventStore, run_id: str) -> bool:
    with store.db.connection() as conn:
        return bool(scalar(conn, "SELECT EXISTS (SELECT 1 FROM events WHERE stream_id = %s"
                                 " AND type = 'run_created')", (run_stream_id(run_id),)))


def _newest(store: EventStore, run_id: str) -> int:
    with store.db.connection() as conn:
        return int(scalar(
            conn,
            f"SELECT coalesce(max(({safe_data('data')}->>'version')::int), 0) FROM events"
            " WHERE stream_id = %s AND type = 'policy_updated'", (run_stream_id(run_id),)))


def newest_policy(store: EventStore, run_id: str, *, at_most: int | None = None
                  ) -> tuple[int, str | None]:
    """The version and checkpoint of the run's newest ``policy_updated`` (``(0, None)`` when
    it has none, or when there is no such run), read without the engines' reports. With
    ``at_most``, the newest of the versions up to it (a policy an older batch is pinned to)."""
    data = safe_data("data")
    below = f" AND ({data}->>'version')::int <= %s" if at_most is not None else ""
    with store.db.connection() as conn:
        row = conn.execute(
            f"SELECT ({data}->>'version')::int, {data}->>'checkpoint' FROM events"
            f" WHERE stream_id = %s AND type = 'policy_updated'{below}"
            f" ORDER BY ({data}->>'version')::int DESC, stream_version DESC LIMIT 1",
            (run_stream_id(run_id), *([at_most] if at_most is not None else []))).fetchone()
    return (int(row[0]), row[1]) if row else (0, None)


def newest_policy_version(store: EventStore, run_id: str) -> int:
    """The run's newest ``policy_updated`` version (0 when none); NotFoundError for an
    unknown run."""
    if not _run_exists(store, run_id):
        raise errors.NotFoundError(f"no run {run_id!r}")
    return _newest(store, run_id)


def record_policy_served(store: EventStore, run_id: str, *, version: int, engine: str,
                         backend: str, source: str | None = None,
                         load_seconds: float | None = None) -> AppendResult:
    """Append ``policy_served``: ``engine`` (a stable id, 1–200 characters) of kind
    ``backend`` (1–100) now serves ``version`` of ``run_id``; ``source`` is where the weights
    came from, ``load_seconds`` how long loading took.

    Bad input is refused before anything is stored: TypeError for a ``run_id``, ``engine``,
    ``backend`` or ``source`` that is not a string, or a ``version`` that is not an integer
    (booleans included) or ``load_seconds`` that is not a number; ``ValidationError`` (a
    ValueError) naming the field for a negative version, a version the run never recorded
    (above its newest ``policy_updated``), a blank or overlong text, or a negative or
    non-finite ``load_seconds``; ``NotFoundError`` for an unknown run.
    """
    if not isinstance(run_id, str):
        raise TypeError(f"run_id must be a string, got {type(run_id).__name__}")
    if isinstance(version, bool) or not isinstance(version, int):
        raise TypeError(f"version must be an integer, got {version!r:.60}")
    if version < 0:
        raise errors.ValidationError(f"version must be >= 0, got {version}", field="version")
    _text("engine", engine, limit=200)
    _text("backend", backend, limit=100)
    if source is not None:
        _text("source", source, limit=2000)
    if load_seconds is not None:
        if isinstance(load_seconds, bool) or not isinstance(load_seconds, int | float):
            raise TypeError(f"load_seconds must be a number, got {load_seconds!r:.60}")
        if not math.isfinite(load_seconds) or load_seconds < 0:
            raise errors.ValidationError(f"load_seconds must be a finite number >= 0, got "
                                         f"{load_seconds!r}", field="load_seconds")
    newest = newest_policy_version(store, run_id)
    if version > newest:
        raise errors.ValidationError(
            f"run {run_id!r} has no policy version {version} (its newest is {newest})",
            field="version")
    return store.append(run_stream_id(run_id), [PolicyServed(
        version=version, engine=engine, backend=backend, source=source,
        load_seconds=None if load_seconds is None else float(load_seconds))])


def append_policy_updated(store: EventStore, run_id: str, event: PolicyUpdated
                          ) -> AppendResult | None:
    """Append ``event`` to the run's stream unless its version is taken: None when another
    ``policy_updated`` of that version or a newer one is there (a racing trainer won; the
    caller saves under the next version). Appends of other events meanwhile (engines'
    ``policy_served``) are waited out. Raises what ``EventStore.append`` raises."""
    stream = run_stream_id(run_id)
    while True:
        expected = store.stream_version(stream)
        if _newest(store, run_id) >= event.version:
            return None
        try:
            return store.append(stream, [event], expected)
        except errors.ConflictError:
            continue


def policy_takeup(store: EventStore, run_id: str, *, version: int | None = None
                  ) -> list[VersionTakeup]:
    """Every policy version of the run (only ``version`` when given), oldest first, with the
    engines that took it (module docstring); version 0 is listed when an engine reported it.
    An engine's repeated reports of one version (it reloaded it) count once, at the first.
    NotFoundError for an unknown run."""
    if not _run_exists(store, run_id):
        raise errors.NotFoundError(f"no run {run_id!r}")
    data = safe_data("data")
    sql = (f"SELECT type, {data} AS data, recorded_at FROM events WHERE stream_id = %s"
           " AND type IN ('policy_updated', 'policy_served')")
    params: list[object] = [run_stream_id(run_id)]
    if version is not None:
        sql += f" AND ({data}->>'version')::int = %s"
        params.append(int(version))
    with store.db.connection() as conn:
        rows = conn.cursor(row_factory=dict_row).execute(
            sql + " ORDER BY stream_version", params).fetchall()
    updates: dict[int, tuple[int, dt.datetime, str | None]] = {}
    served: dict[int, dict[str, EngineTakeup]] = {}
    for row in rows:
        fields, at = row["data"], row["recorded_at"]
        number = int(fields["version"])
        if row["type"] == "policy_updated":
            updates.setdefault(number, (int(fields["step"]), at, fields.get("checkpoint")))
            continue
        engines = served.setdefault(number, {})
        if fields["engine"] in engines:
            continue
        update = updates.get(number)
        engines[fields["engine"]] = EngineTakeup(
            engine=fields["engine"], backend=fields["backend"], served_at=at,
            lag_seconds=(at - update[1]).total_seconds() if update is not None else None,
            load_seconds=fields.get("load_seconds"), source=fields.get("source"))
    out = []
    for number in sorted(set(updates) | set(served)):
        step, updated_at, checkpoint = updates.get(number, (None, None, None))
        out.append(VersionTakeup(version=number, step=step, updated_at=updated_at,
                                 checkpoint=checkpoint,
                                 engines=tuple(served.get(number, {}).values())))
    return out
