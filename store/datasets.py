"""Named, versioned datasets: the tables of migration 0015 and everything that reads or
writes them, plus the two reads of the log a derivation starts from (the runs' projects and
their episodes).

A version is written whole in one transaction (``write_version``) and never changed after:
the database refuses UPDATE of both tables and DELETE of a version's rows while the version
exists. ``delete_version`` deletes a version with its rows, refused while a training step
that trained it is recorded (``dataset_trained_by``, written by ``record_trained_by``).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psycopg
from psycopg.rows import dict_row

from store import errors
from store.db import Database
from store.recorder import Recorder
from store.rows import safe_data
from store.stream_rules import run_stream_id

__all__ = ["DatasetRow", "DatasetVersion", "delete_version", "get_version",
           "list_versions", "read_row_summaries", "read_rows", "record_trained_by",
           "run_episode_ids", "run_projects", "write_version"]

_DATA = safe_data("data")


@dataclass(frozen=True)
class DatasetRow:
    """One sample of a dataset version. ``token_ids`` (int32), ``loss_mask`` (uint8, 0/1)
    and ``logprobs`` (float32, 0 where not sampled) have one entry per token. ``reward`` is
    the reward the rules gave; ``advantage`` is set when the rules compute one.
    ``failure_type``: a negative's first error type; for a positive sample, the first error
    type its episode met (None: none). ``row_hash``: sha256 of the row's content."""

    run_id: str
    group_id: str
    episode_id: str
    agent: str
    kind: str
    timeline_index: int
    prompt_length: int
    token_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    reward: float
    row_hash: str
    advantage: float | None = None
    failure_type: str | None = None
    error_types: list[str] | None = None

    @property
    def key(self) -> tuple[str, str, int]:
        """What identifies the row across versions: ``(episode_id, kind, timeline_index)``."""
        return (self.episode_id, self.kind, self.timeline_index)


@dataclass(frozen=True)
class DatasetVersion:
    """One version of a named dataset (the row of ``datasets``)."""

    dataset_id: int
    project: str
    name: str
    version: int
    content_hash: str
    rules: dict[str, Any]
    run_ids: list[str]
    code_version: str
    num_rows: int
    num_episodes: int
    excluded: dict[str, int]
    created_at: dt.datetime
    trained_by: list[dict[str, Any]] = field(default_factory=list)


_VERSION_COLUMNS = ("dataset_id, project, name, version, content_hash, rules, run_ids,"
                    " code_version, num_rows, num_episodes, excluded, created_at")


def _version(row: dict[str, Any], trained_by: list[dict[str, Any]] | None = None
             ) -> DatasetVersion:
    return DatasetVersion(**row, trained_by=trained_by or [])


def run_projects(store: Recorder, run_ids: Sequence[str], *,
                 conn: psycopg.Connection | None = None) -> dict[str, str]:
    """The project of each run of ``run_ids`` that has a ``run_created`` (an unknown run is
    absent), read on ``conn`` (a connection of ``store.db``) when given."""
    if conn is None:
        with store.db.connection() as own:
            return run_projects(store, run_ids, conn=own)
    wanted = {run_stream_id(r): r for r in run_ids}
    rows = conn.execute(
        f"SELECT stream_id, coalesce({_DATA}->>'project', 'default') FROM events"
        " WHERE stream_id = ANY(%s) AND stream_version = 1 AND type = 'run_created'",
        (list(wanted),)).fetchall()
    return {wanted[stream]: project for stream, project in rows}


def run_episode_ids(store: Recorder, run_ids: Sequence[str], *,
                    conn: psycopg.Connection | None = None) -> list[str]:
    """The episodes of ``run_ids`` (every stream with an ``episode_started`` of one of the
    runs), in the order they were started, read on ``conn`` (a connection of ``store.db``)
    when given."""
    if conn is None:
        with store.db.connection() as own:
            return run_episode_ids(store, run_ids, conn=own)
    rows = conn.execute(
        "SELECT stream_id FROM events WHERE run_id = ANY(%s) AND type = 'episode_started'"
        " ORDER BY position", (list(run_ids),)).fetchall()
    return list(dict.fromkeys(r[0] for r in rows))


def _lock_name(conn: Any, project: str, name: str) -> None:
    conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 15))",
                 (f"dataset\x1f{project}\x1f{name}",))


def write_version(db: Database, *, project: str, name: str, content_hash: str,
                  rules: dict[str, Any], run_ids: Sequence[str], code_version: str,
                  rows: Sequence[DatasetRow], num_episodes: int,
                  excluded: dict[str, int]) -> tuple[DatasetVersion, bool]:
    """Store a new version of dataset ``name`` of ``project`` with ``rows`` (in their order)
    in one transaction, and return it with True; when the name already holds a version of
    ``content_hash``, store nothing and return that version with False. Versions of a name
    are numbered 1, 2, 3... in the order they were made, a number never given twice (not
    even after its version was deleted); concurrent writers of one name take turns. Raises
    ValidationError when ``rows`` is empty."""
    if not rows:
        raise errors.ValidationError("a dataset version needs at least one row",
                                     field="rows")
    with db.transaction() as conn:
        _lock_name(conn, project, name)
        cur = conn.cursor(row_factory=dict_row)
        found = cur.execute(
            f"SELECT {_VERSION_COLUMNS} FROM datasets WHERE project = %s AND name = %s"
            " AND content_hash = %s", (project, name, content_hash)).fetchone()
        if found is not None:
            return _version(found), False
        number = cur.execute(
            "INSERT INTO dataset_names (project, name, last_version) VALUES (%s, %s, 1)"
            " ON CONFLICT (project, name) DO UPDATE"
            " SET last_version = dataset_names.last_version + 1 RETURNING last_version",
            (project, name)).fetchone()
        assert number is not None
        made = cur.execute(
            "INSERT INTO datasets (project, name, version, content_hash, rules, run_ids,"
            " code_version, num_rows, num_episodes, excluded)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
            f" RETURNING {_VERSION_COLUMNS}",
            (project, name, number["last_version"], content_hash,
             json.dumps(rules, sort_keys=True), list(run_ids), code_version, len(rows),
             num_episodes, json.dumps(excluded, sort_keys=True))).fetchone()
        assert made is not None
        dataset_id = made["dataset_id"]
        with conn.cursor().copy(
                "COPY dataset_rows (dataset_id, row_index, run_id, group_id, episode_id, agent,"
                " kind, timeline_index, prompt_length, num_tokens, num_trainable, reward,"
                " advantage, failure_type, error_types, token_ids, loss_mask, logprobs,"
                " row_hash) FROM STDIN") as copy:
            for i, r in enumerate(rows):
                mask = np.asarray(r.loss_mask, dtype=np.uint8)
                copy.write_row((
                    dataset_id, i, r.run_id, r.group_id, r.episode_id, r.agent, r.kind,
                    r.timeline_index, r.prompt_length, len(r.token_ids), int(mask.sum()),
                    r.reward, r.advantage, r.failure_type, r.error_types,
                    np.asarray(r.token_ids, dtype="<i4").tobytes(), mask.tobytes(),
                    np.asarray(r.logprobs, dtype="<f4").tobytes(), r.row_hash))
        return _version(made), True


def _trained_by(conn: Any, dataset_ids: list[int]) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for row in conn.cursor(row_factory=dict_row).execute(
            "SELECT dataset_id, run_id, step, recorded_at FROM dataset_trained_by"
            " WHERE dataset_id = ANY(%s) ORDER BY run_id, step", (dataset_ids,)).fetchall():
        out.setdefault(row.pop("dataset_id"), []).append(row)
    return out


def get_version(db: Database, project: str, name: str, version: int | None = None
                ) -> DatasetVersion | None:
    """Version ``version`` of dataset ``name`` of ``project`` (the latest when None), or
    None when there is no such version."""
    with db.connection() as conn:
        cur = conn.cursor(row_factory=dict_row)
        if version is None:
            row = cur.execute(
                f"SELECT {_VERSION_COLUMNS} FROM datasets WHERE project = %s AND name = %s"
                " ORDER BY version DESC LIMIT 1", (project, name)).fetchone()
        else:
            row = cur.execute(
                f"SELECT {_VERSION_COLUMNS} FROM datasets WHERE project = %s AND name = %s"
                " AND version = %s", (project, name, version)).fetchone()
        if row is None:
            return None
        return _version(row, _trained_by(conn, [row["dataset_id"]]).get(row["dataset_id"]))


def list_versions(db: Database, project: str, name: str | None = None
                  ) -> list[DatasetVersion]:
    """Every version of the datasets of ``project`` (of ``name`` only, when given), by name
    then version."""
    with db.connection() as conn:
        rows = conn.cursor(row_factory=dict_row).execute(
            f"SELECT {_VERSION_COLUMNS} FROM datasets WHERE project = %s"
            " AND (%s::text IS NULL OR name = %s) ORDER BY name, version",
            (project, name, name)).fetchall()
        trained = _trained_by(conn, [r["dataset_id"] for r in rows])
    return [_version(r, trained.get(r["dataset_id"])) for r in rows]


def read_rows(db: Database, dataset_id: int, *, offset: int = 0, limit: int | None = None
              ) -> list[DatasetRow]:
    """The rows of a version in their order, from ``offset``, at most ``limit``."""
    with db.connection() as conn:
        rows = conn.cursor(row_factory=dict_row).execute(
            "SELECT run_id, group_id, episode_id, agent, kind, timeline_index, prompt_length,"
            " reward, advantage, failure_type, error_types, token_ids, loss_mask, logprobs,"
            " row_hash FROM dataset_rows WHERE dataset_id = %s ORDER BY row_index"
            " OFFSET %s LIMIT %s", (dataset_id, offset, limit)).fetchall()
    out = []
    for r in rows:
        r["token_ids"] = np.frombuffer(r["token_ids"], dtype="<i4")
        r["loss_mask"] = np.frombuffer(r["loss_mask"], dtype=np.uint8)
        r["logprobs"] = np.frombuffer(r["logprobs"], dtype="<f4")
        out.append(DatasetRow(**r))
    return out


def read_row_summaries(db: Database, dataset_id: int) -> list[dict[str, Any]]:
    """Every row of a version without its tokens: episode_id, kind, timeline_index,
    row_hash, reward, advantage, failure_type, in order (what a comparison needs)."""
    with db.connection() as conn:
        return conn.cursor(row_factory=dict_row).execute(
            "SELECT episode_id, kind, timeline_index, row_hash, reward, advantage,"
            " failure_type FROM dataset_rows WHERE dataset_id = %s ORDER BY row_index",
            (dataset_id,)).fetchall()


def delete_version(db: Database, project: str, name: str, version: int) -> None:
    """Delete version ``version`` of dataset ``name`` with its rows. Raises NotFoundError
    when there is no such version and RefusedError when a training step that trained it is
    recorded (the version stays as it is)."""
    with db.transaction() as conn:
        row = conn.execute(
            "SELECT dataset_id FROM datasets WHERE project = %s AND name = %s AND version = %s"
            " FOR UPDATE", (project, name, version)).fetchone()
        if row is None:
            raise errors.NotFoundError(f"no dataset {name!r} version {version}")
        steps = conn.execute(
            "SELECT run_id, step FROM dataset_trained_by WHERE dataset_id = %s"
            " ORDER BY run_id, step", (row[0],)).fetchall()
        if steps:
            named = ", ".join(f"run {r} step {s}" for r, s in steps[:5])
            raise errors.RefusedError(
                f"dataset {name!r} version {version} cannot be deleted: {len(steps)} training "
                f"step(s) trained it ({named})")
        conn.execute("DELETE FROM datasets WHERE dataset_id = %s", (row[0],))


def record_trained_by(db: Database, dataset_id: int, *, run_id: str, step: int) -> None:
    """Record that step ``step`` of run ``run_id`` trained the version ``dataset_id`` (from
    then on it cannot be deleted). Recording the same step twice stores it once."""
    with db.transaction() as conn:
        conn.execute("INSERT INTO dataset_trained_by (dataset_id, run_id, step)"
                     " VALUES (%s, %s, %s) ON CONFLICT DO NOTHING", (dataset_id, run_id, step))
