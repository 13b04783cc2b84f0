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

A checkpoint a ``policy_updated`` names is loaded by every rollout engine of the run, so one
received from a client must lie under the configured checkpoint root
(:func:`checkpoint_problem`, :func:`checkpoint_root`).
"""

from __future__ import annotations

import datetime as dt
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from psycopg.rows import dict_row

from store import errors
from store.db import scalar
from store.eventlog import AppendResult, EventStore, run_stream_id
from store.events import PolicyServed, PolicyUpdated
from store.rows import safe_data
from store.settings import Settings

__all__ = [
    "EngineTakeup",
    "VersionTakeup",
    "append_policy_updated",
    "call_policy_versions",
    "checkpoint_problem",
    "checkpoint_root",
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


_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def checkpoint_root(settings: Settings) -> str:
    """Where the run's checkpoints live: the ``checkpoint_root`` setting (a folder or an
    fsspec URL), else ``<data_dir>/checkpoints`` (where a trainer writes them then)."""
    return settings.checkpoint_root or str(settings.data_dir / "checkpoints")


def _local_path(location: str) -> str | None:
    """The path of a ``file://`` URL on this host (None for another host), or ``location``
    itself when it is no URL."""
    if not location.lower().startswith("file://"):
        return location
    parts = urlsplit(location)
    if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
        return None
    return unquote(parts.path)


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate names no file
        return False
    return True


def checkpoint_problem(location: object, root: str) -> str | None:
    """Why ``location`` (a ``policy_updated``'s checkpoint) may not be recorded, or None
    when it may: it must lie strictly under ``root``.

    A local ``root`` (a folder, or a ``file://`` URL) takes absolute paths and ``file://``
    URLs of this host; both sides are resolved (symbolic links, ``..``) before comparing,
    so no spelling escapes it. A URL ``root`` (``s3://bucket/prefix``) takes URLs of the
    same scheme and host whose path continues the root's, without ``.`` or ``..``
    segments (also percent-encoded), query or fragment. None (no checkpoint) is accepted;
    anything that is not a non-blank string is refused."""
    if location is None:
        return None
    where = f"the checkpoint root {root!r} (setting checkpoint_root)"
    if (not isinstance(location, str) or not location.strip() or "\x00" in location
            or not _encodes(location)):
        return f"checkpoint must be a path or URL under {where}, got {location!r:.80}"
    outside = f"checkpoint {location!r:.200} is not under {where}"
    local_root = _local_path(root)
    if local_root is not None and not _URL.match(local_root):
        path = _local_path(location)
        if path is None or _URL.match(path):
            return outside
        if not os.path.isabs(path):
            return f"checkpoint {location!r:.200} must be an absolute path under {where}"
        base = os.path.realpath(os.path.expanduser(local_root))
        real = os.path.realpath(path)
        if real == base or not real.startswith(base.rstrip(os.sep) + os.sep):
            return outside
        return None
    parts, base_parts = urlsplit(location), urlsplit(root)
    if (not _URL.match(location) or parts.scheme.lower() != base_parts.scheme.lower()
            or parts.netloc.lower() != base_parts.netloc.lower()
            or parts.query or parts.fragment):
        return outside
    segments = unquote(parts.path).split("/")
    if any(s in (".", "..") for s in segments) or "\\" in parts.path:
        return f"checkpoint {location!r:.200} must not hold '.' or '..' segments"
    wanted = [s for s in base_parts.path.split("/") if s]
    given = [s for s in segments if s]
    if len(given) <= len(wanted) or given[:len(wanted)] != wanted:
        return outside
    return None


def call_policy_versions(store: EventStore, episode_ids: Sequence[str]) -> dict[str, list[int]]:
    """The policy version of every LLM call of each episode of ``episode_ids``, in call
    order (each ``llm_called`` records its own; an episode played across policy updates,
    ``rollout.continue_across_updates``, holds several). An episode without calls, or not
    stored, is left out. A call written before the field existed reads as version 0."""
    ids = sorted({str(e) for e in episode_ids})
    if not ids:
        return {}
    data = safe_data("data")
    sql = (f"SELECT stream_id, COALESCE(({data}->>'policy_version')::int, 0) AS version"
           " FROM events WHERE stream_id = ANY(%s) AND type = 'llm_called'"
           " ORDER BY stream_id, stream_version")
    with store.db.connection() as conn:
        rows = conn.execute(sql, [ids]).fetchall()
    out: dict[str, list[int]] = {}
    for stream_id, version in rows:
        out.setdefault(str(stream_id), []).append(int(version))
    return out
