"""Projection tables written by replay: runs, episodes, samples, timeline forks, failures,
tool calls.

A replayed episode is written in one transaction together with its checkpoint (the stream
version it was replayed at, ``episodes.projected_version``), alone or in a batch of episodes
(``write_many``: one statement per table for the whole batch): writing the same projection
twice changes nothing, and an episode already projected at its final version is skipped, so
a redelivered replay task does no harm. ``rebuild`` empties every projection so that they can
be replayed from the log alone; samples keep their lease state across a rebuild so that
nothing already trained is trained again. A sample a trainer leased or consumed is never
changed or deleted by a later projection of its episode: the projection records what it
wanted in ``projection_conflicts`` instead (``Projections.conflicts`` lists them).

Samples are written ``ready`` to train, or ``no_reward`` when their episode has no reward yet
(no reward is invented: leasing never takes them) or the log already holds a newer event of
the episode (a late reward) whose projection will replace them.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from store.arguments import whole_number
from store.codec import pack_ids, pack_logprobs, pack_mask, unpack_ids, unpack_logprobs, unpack_mask
from store.db import scalar
from store.eventlog import EventStore, LogPosition

__all__ = [
    "RunRow",
    "EpisodeRow",
    "SampleRow",
    "ForkRow",
    "FailureRow",
    "ToolCallRow",
    "EpisodeProjection",
    "Projections",
]


@dataclass(frozen=True)
class RunRow:
    run_id: str
    project: str
    group_size: int
    max_negatives_per_group: int
    save_negative_samples: bool
    config: dict[str, Any]
    created_at: dt.datetime


@dataclass(frozen=True)
class EpisodeRow:
    episode_id: str
    run_id: str
    group_id: str
    status: str
    projected_version: int
    task_id: str | None = None
    invalid_reason: str | None = None
    reward: float | None = None
    policy_version: int | None = None
    llm_calls: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    attempts_failed: int = 0
    rollbacks: int = 0
    timelines: int = 0
    survivors: int = 0
    forks: int = 0
    drifted_messages: int = 0
    negatives: int = 0
    tokens: int = 0
    started_at: dt.datetime | None = None
    finished_at: dt.datetime | None = None
    # The code version that replayed the episode (``workers.replay.code_version``).
    projected_by: str | None = None


@dataclass(frozen=True)
class SampleRow:
    run_id: str
    group_id: str
    episode_id: str
    agent: str
    kind: str  # "positive" | "negative"
    timeline_index: int
    reward: float | None
    policy_version: int | None
    prompt_length: int
    token_ids: np.ndarray  # (num_tokens,) int32
    loss_mask: np.ndarray  # (num_tokens,) 0/1
    logprobs: np.ndarray  # (num_tokens,) float32, 0 where not sampled
    num_drifted: int = 0
    failed_at: dt.datetime | None = None
    failure_version: int | None = None
    position_key: str | None = None
    retry_index: int | None = None
    error_types: Sequence[str] | None = None
    error_messages: Sequence[str] | None = None


@dataclass(frozen=True)
class ForkRow:
    episode_id: str
    agent: str
    timeline: int
    other: int
    message_index: int
    reason: str


@dataclass(frozen=True)
class FailureRow:
    run_id: str
    group_id: str
    episode_id: str
    agent: str
    source: str  # "tool" | "attempt"
    stream_version: int
    policy_version: int | None = None
    tool_name: str | None = None
    error_type: str | None = None
    error_message: str | None = None
    position_key: str | None = None
    retry_index: int | None = None
    recovered: bool = False
    occurred_at: dt.datetime | None = None
    # the agent rolled back this failure's attempt and tried the position again
    retried: bool = False
    # retries from this failure until the position was passed (None: never passed)
    retries_to_recover: int | None = None


@dataclass(frozen=True)
class ToolCallRow:
    """One ``tool_returned`` of an episode (the denominators of tool error rates)."""

    run_id: str
    group_id: str
    episode_id: str
    agent: str
    stream_version: int
    tool_name: str
    is_error: bool
    policy_version: int | None = None
    error_type: str | None = None
    position_key: str | None = None
    duration_ms: float | None = None
    occurred_at: dt.datetime | None = None


@dataclass(frozen=True)
class EpisodeProjection:
    """Everything one replayed episode writes."""

    run: RunRow
    episode: EpisodeRow
    samples: list[SampleRow] = field(default_factory=list)
    forks: list[ForkRow] = field(default_factory=list)
    failures: list[FailureRow] = field(default_factory=list)
    tool_calls: list[ToolCallRow] = field(default_factory=list)


def _sample_values(s: SampleRow, status: str) -> tuple[Any, ...]:
    n_ids, n_mask, n_logp = len(s.token_ids), len(s.loss_mask), len(s.logprobs)
    if not (n_ids == n_mask == n_logp):
        raise ValueError(
            f"sample of {s.episode_id} has {n_ids} ids, {n_mask} mask entries and "
            f"{n_logp} logprobs; they must be equal"
        )
    return (
        s.run_id, s.group_id, s.episode_id, s.agent, s.kind, s.timeline_index, s.reward,
        s.policy_version, s.prompt_length, n_ids, int(np.count_nonzero(s.loss_mask)),
        s.num_drifted, pack_ids(s.token_ids), pack_mask(s.loss_mask),
        pack_logprobs(s.logprobs), s.failed_at, s.failure_version,
        s.position_key, s.retry_index,
        Jsonb(list(s.error_types)) if s.error_types is not None else None,
        Jsonb(list(s.error_messages)) if s.error_messages is not None else None,
        status,
    )


def _columns(rows: Sequence[Sequence[Any]], width: int) -> list[list[Any]]:
    """Rows turned into ``width`` columns, one list per column (the arrays a multi-row
    ``INSERT ... SELECT * FROM unnest(...)`` takes)."""
    columns: list[list[Any]] = [[] for _ in range(width)]
    for row in rows:
        for column, value in zip(columns, row, strict=True):
            column.append(value)
    return columns


def _unnest_insert(table: str, row_type: type, types: dict[str, str]) -> str:
    """``INSERT INTO table (...) SELECT * FROM unnest(...)`` with one binary array parameter
    per column of ``types`` (column -> element type), in its order: the statement that writes
    rows of the dataclass ``row_type``, whose fields are named as the columns. Raises
    ValueError (at import) when the fields and the columns differ, so that a field added to
    a row type cannot go unwritten."""
    names = {f.name for f in fields(row_type)}
    if names != set(types):
        raise ValueError(f"{row_type.__name__} fields {sorted(names)} differ from the columns "
                         f"of {table}: {sorted(types)}")
    return (f"INSERT INTO {table} ({', '.join(types)}) SELECT * FROM unnest("
            + ", ".join(f"%b::{t}[]" for t in types.values()) + ")")


def _row_columns(rows: Sequence[Any], types: dict[str, str]) -> list[list[Any]]:
    """The column arrays of an ``_unnest_insert`` statement for dataclass ``rows``."""
    return _columns([tuple(getattr(r, c) for c in types) for r in rows], len(types))


#: Column -> array element type of the tables written as dataclass rows, and their inserts.
_EPISODE_TYPES = {
    "episode_id": "text", "run_id": "text", "group_id": "text", "status": "text",
    "projected_version": "int", "task_id": "text", "invalid_reason": "text",
    "reward": "float8", "policy_version": "int", "llm_calls": "int", "tool_calls": "int",
    "tool_errors": "int", "attempts_failed": "int", "rollbacks": "int", "timelines": "int",
    "survivors": "int", "forks": "int", "drifted_messages": "int", "negatives": "int",
    "tokens": "int", "started_at": "timestamptz", "finished_at": "timestamptz",
    "projected_by": "text",
}
_FORK_TYPES = {"episode_id": "text", "agent": "text", "timeline": "int", "other": "int",
               "message_index": "int", "reason": "text"}
_TOOL_CALL_TYPES = {
    "run_id": "text", "group_id": "text", "episode_id": "text", "agent": "text",
    "stream_version": "int", "tool_name": "text", "is_error": "boolean", "policy_version": "int",
    "error_type": "text", "position_key": "text", "duration_ms": "float8",
    "occurred_at": "timestamptz",
}
_FAILURE_TYPES = {
    "run_id": "text", "group_id": "text", "episode_id": "text", "agent": "text",
    "policy_version": "int", "source": "text", "stream_version": "int", "tool_name": "text",
    "error_type": "text", "error_message": "text", "position_key": "text",
    "retry_index": "int", "recovered": "boolean", "occurred_at": "timestamptz",
    "retried": "boolean", "retries_to_recover": "int",
}
_EPISODE_INSERT = _unnest_insert("episodes", EpisodeRow, _EPISODE_TYPES)
_FORK_INSERT = _unnest_insert("timeline_forks", ForkRow, _FORK_TYPES)
_TOOL_CALL_INSERT = _unnest_insert("tool_calls", ToolCallRow, _TOOL_CALL_TYPES)
_FAILURE_INSERT = _unnest_insert("failures", FailureRow, _FAILURE_TYPES)

_SAMPLE_COLUMNS = (
    "run_id, group_id, episode_id, agent, kind, timeline_index, reward, policy_version,"
    " prompt_length, num_tokens, num_trainable, num_drifted, token_ids, loss_mask, logprobs,"
    " failed_at, failure_version, position_key, retry_index, error_types, error_messages,"
    " status"
)

#: Sample states a trainer holds: a re-projection never changes or deletes such a sample.
_PROTECTED = "('leased', 'consumed')"
#: The sample columns a re-projection may want to change (all but the key).
_SAMPLE_VALUE_COLUMNS = [c.strip() for c in _SAMPLE_COLUMNS.split(",")
                         if c.strip() not in ("episode_id", "kind", "timeline_index", "status")]
#: The status of a sample written by a projection: ``ready`` to train, or ``no_reward`` when
#: its episode has no reward yet, or when a newer event (a late reward) is in the log and
#: the projection that replays it will replace the sample.
_READY, _NO_REWARD = "ready", "no_reward"
#: An episode row written again replaces the earlier one in place, so that the samples that
#: reference it (leased and consumed ones stay) are not deleted with it.
_EPISODE_UPSERT = (_EPISODE_INSERT + " ON CONFLICT (episode_id) DO UPDATE SET "
                   + ", ".join(f"{c} = excluded.{c}" for c in _EPISODE_TYPES
                               if c != "episode_id")
                   + ", projected_at = now()")
_NEW_SAMPLES = (
    "SELECT r AS run_id, g AS group_id, e AS episode_id, a AS agent, k AS kind,"
    " ti AS timeline_index, rw AS reward, pv AS policy_version, pl AS prompt_length,"
    " nt AS num_tokens, ntr AS num_trainable, nd AS num_drifted, ids AS token_ids,"
    " mask AS loss_mask, lp AS logprobs, fa AS failed_at, fv AS failure_version,"
    " pk AS position_key, ri AS retry_index,"
    " CASE WHEN et IS NULL THEN NULL ELSE ARRAY(SELECT x FROM"
    " jsonb_array_elements_text(et) WITH ORDINALITY AS t(x, n) ORDER BY n) END AS error_types,"
    " CASE WHEN em IS NULL THEN NULL ELSE ARRAY(SELECT x FROM"
    " jsonb_array_elements_text(em) WITH ORDINALITY AS t(x, n) ORDER BY n) END"
    " AS error_messages, st AS status"
    " FROM unnest(%b::text[], %b::text[], %b::text[], %b::text[], %b::text[],"
    " %b::int[], %b::float8[], %b::int[], %b::int[], %b::int[], %b::int[],"
    " %b::int[], %b::bytea[], %b::bytea[], %b::bytea[], %b::timestamptz[],"
    " %b::int[], %b::text[], %b::int[], %b::jsonb[], %b::jsonb[], %b::text[])"
    " AS s(r, g, e, a, k, ti, rw, pv, pl, nt, ntr, nd, ids, mask, lp, fa, fv, pk, ri, et, em,"
    " st)"
)
_CONFLICT_COLUMNS = ("episode_id, run_id, kind, timeline_index, sample_id, sample_status,"
                     " action, columns, projected_version")
#: New samples of episodes never projected.
_SAMPLE_INSERT = f"INSERT INTO samples ({_SAMPLE_COLUMNS}) SELECT * FROM ({_NEW_SAMPLES}) s"
#: New samples of episodes projected before: where a leased or consumed sample has the key,
#: it stays as it is, and a conflict names the columns the new one would have changed.
_SAMPLE_INSERT_KEEPING = (
    f"WITH s AS MATERIALIZED ({_NEW_SAMPLES}),"
    f" conflicts AS (INSERT INTO projection_conflicts ({_CONFLICT_COLUMNS})"
    " SELECT o.episode_id, o.run_id, o.kind, o.timeline_index, o.sample_id, o.status,"
    " 'change', d.columns, ep.projected_version"
    " FROM s JOIN samples o ON o.episode_id = s.episode_id AND o.kind = s.kind"
    " AND o.timeline_index = s.timeline_index"
    " JOIN episodes ep ON ep.episode_id = s.episode_id"
    " CROSS JOIN LATERAL (SELECT ARRAY(SELECT c FROM unnest("
    "ARRAY[" + ", ".join(f"'{c}'" for c in _SAMPLE_VALUE_COLUMNS) + "]::text[], "
    "ARRAY[" + ", ".join(f"o.{c} IS DISTINCT FROM s.{c}" for c in _SAMPLE_VALUE_COLUMNS)
    + "]) AS x(c, differs) WHERE differs) AS columns) d"
    f" WHERE o.status IN {_PROTECTED} AND cardinality(d.columns) > 0"
    " ON CONFLICT ON CONSTRAINT projection_conflicts_once DO NOTHING)"
    f" INSERT INTO samples ({_SAMPLE_COLUMNS}) SELECT * FROM s"
    " ON CONFLICT ON CONSTRAINT samples_key DO NOTHING"
)
#: Leased and consumed samples of episodes projected again that the new projection does not
#: make (parameters: the episodes, then the keys of the samples it makes).
_DELETE_CONFLICTS = (
    f"INSERT INTO projection_conflicts ({_CONFLICT_COLUMNS})"
    " SELECT o.episode_id, o.run_id, o.kind, o.timeline_index, o.sample_id, o.status,"
    " 'delete', '{}', ep.projected_version"
    " FROM samples o JOIN episodes ep ON ep.episode_id = o.episode_id"
    f" WHERE o.episode_id = ANY(%s::text[]) AND o.status IN {_PROTECTED}"
    " AND NOT EXISTS (SELECT 1 FROM unnest(%s::text[], %s::text[], %s::int[]) AS m(e, k, ti)"
    " WHERE m.e = o.episode_id AND m.k = o.kind AND m.ti = o.timeline_index)"
    " ON CONFLICT ON CONSTRAINT projection_conflicts_once DO NOTHING"
)


def _sample_status(projection: EpisodeProjection, current: dict[str, int]) -> str:
    """The status a projection gives its samples: ``no_reward`` when the episode has no
    reward, or when the log holds a newer event of it (``current``: the streams' versions)
    than this projection replayed; ``ready`` otherwise."""
    episode = projection.episode
    newer = current.get(episode.episode_id, 0) > episode.projected_version
    return _NO_REWARD if episode.reward is None or newer else _READY


class Projections:
    """Reads and writes the projection tables of one store."""

    def __init__(self, store: EventStore) -> None:
        self.store = store
        self.db = store.db

    def projected_version(self, episode_id: str) -> int | None:
        """The stream version an episode was replayed at (None: never)."""
        with self.db.connection() as conn:
            row = conn.execute(
                "SELECT projected_version FROM episodes WHERE episode_id = %s", (episode_id,)
            ).fetchone()
        return None if row is None else row[0]

    def projected_versions(self, episode_ids: Sequence[str], *,
                           conn: psycopg.Connection | None = None) -> dict[str, int]:
        """The stream versions the given episodes were replayed at (those never replayed are
        left out); read on ``conn`` when given."""
        if not episode_ids:
            return {}
        if conn is None:
            with self.db.connection() as own:
                return self.projected_versions(episode_ids, conn=own)
        rows = conn.execute(
            "SELECT episode_id, projected_version FROM episodes"
            " WHERE episode_id = ANY(%b::text[])",
            (list(episode_ids),),
        ).fetchall()
        return dict(rows)

    def current_samples(self, episode_ids: Sequence[str], projected_by: str, *,
                        conn: psycopg.Connection | None = None
                        ) -> dict[str, tuple[str, int | None, list[SampleRow]]]:
        """The samples of those of ``episode_ids`` whose projection is current, by episode:
        ``(run_id, policy_version, samples)``, samples in (kind, timeline index) order,
        token columns decoded. Current: replayed at its stream's latest version by the code
        version ``projected_by``, not ``invalid``, no projection conflict ever recorded for
        it (a leased or consumed sample kept from an earlier projection may differ from
        what replay gives now) and holding exactly the samples its replay made (one per
        survivor, none for an aborted episode, and its negatives). Other episodes are left
        out. Read on ``conn`` when given."""
        if not episode_ids:
            return {}
        if conn is None:
            with self.db.connection() as own:
                return self.current_samples(episode_ids, projected_by, conn=own)
        cur = conn.cursor(binary=True)
        rows = cur.execute(
            "SELECT e.episode_id, e.run_id, e.policy_version,"
            " CASE WHEN e.status = 'aborted' THEN 0 ELSE e.survivors END, e.negatives"
            " FROM episodes e WHERE e.episode_id = ANY(%b::text[]) AND e.projected_by = %b"
            " AND e.status NOT IN ('invalid', 'running')"
            " AND e.projected_version = (SELECT max(v.stream_version) FROM events v"
            " WHERE v.stream_id = e.episode_id)"
            " AND NOT EXISTS (SELECT 1 FROM projection_conflicts c"
            " WHERE c.episode_id = e.episode_id)",
            (list(episode_ids), projected_by),
        ).fetchall()
        if not rows:
            return {}
        found: dict[str, list[SampleRow]] = {r[0]: [] for r in rows}
        for (episode_id, group_id, agent, kind, index, reward, policy, prompt, ids, mask,
             logprobs, failure_version, error_types) in cur.execute(
                "SELECT episode_id, group_id, agent, kind, timeline_index, reward,"
                " policy_version, prompt_length, token_ids, loss_mask, logprobs,"
                " failure_version, error_types FROM samples"
                " WHERE episode_id = ANY(%b::text[]) ORDER BY episode_id, kind, timeline_index",
                (list(found),)).fetchall():
            found[episode_id].append(SampleRow(
                run_id="", group_id=group_id, episode_id=episode_id, agent=agent, kind=kind,
                timeline_index=index, reward=reward, policy_version=policy,
                prompt_length=prompt, token_ids=unpack_ids(ids), loss_mask=unpack_mask(mask),
                logprobs=unpack_logprobs(logprobs), failure_version=failure_version,
                error_types=error_types))
        out: dict[str, tuple[str, int | None, list[SampleRow]]] = {}
        for episode_id, run_id, policy, positives, negatives in rows:
            samples = found[episode_id]
            kinds = [s.kind for s in samples]
            if kinds.count("positive") == positives and kinds.count("negative") == negatives:
                out[episode_id] = (run_id, policy, samples)
        return out

    def write(
        self,
        projection: EpisodeProjection,
        *,
        before_commit: Callable[[], None] | None = None,
    ) -> bool:
        """Write one episode's projection and its checkpoint in one transaction.

        Returns False (and writes nothing) when the episode is already projected at this
        stream version or a later one. Rows of an earlier projection of the episode are
        replaced, except samples a trainer leased or consumed: those stay exactly as they
        are, and where the new projection would change one (or make none with its key) a row
        in ``projection_conflicts`` records it; stale and skipped samples keep that state;
        the others are ``ready``, or ``no_reward`` (see the module docstring).
        ``before_commit`` runs inside the transaction after every row is written
        (fault-injection tests use it).
        """
        return self.write_many([projection], before_commit=before_commit)[0]

    def write_many(
        self,
        projections: Sequence[EpisodeProjection],
        *,
        before_commit: Callable[[], None] | None = None,
    ) -> list[bool]:
        """Write several episodes' projections and their checkpoints in one transaction, each
        as ``write`` would (one statement per table, whatever the number of episodes).
        Returns, per projection, whether it was written. Raises ValueError when an episode
        appears twice."""
        ids = [p.episode.episode_id for p in projections]
        if len(set(ids)) != len(ids):
            raise ValueError("write_many got the same episode twice")
        if not projections:
            return []
        with self.db.transaction() as conn:
            # Parameters and results in binary (%b): token tensors travel as raw bytea, not as
            # hex text that psycopg writes in Python and the server parses back.
            cur = conn.cursor(binary=True)
            # Pipelined: statements go out without waiting for each other's results (the
            # lock and the version check are read before the rest is decided).
            with conn.pipeline() as pipeline:
                # Replays of one episode take turns, so that the check below holds until commit;
                # locks are taken in one order so that two batches cannot wait on each other.
                cur.execute(
                    "SELECT pg_advisory_xact_lock(hashtextextended(e, 1))"
                    " FROM unnest(%b::text[]) WITH ORDINALITY AS l(e, n) ORDER BY n",
                    (sorted(ids),),
                )
                done = dict(cur.execute(
                    "SELECT episode_id, projected_version FROM episodes"
                    " WHERE episode_id = ANY(%b::text[])",
                    (ids,),
                ).fetchall())
                todo = [p for p in projections
                        if done.get(p.episode.episode_id) is None
                        or done[p.episode.episode_id] < p.episode.projected_version]
                if not todo:
                    return [False] * len(projections)
                # Read after the lock a late reward's append also takes
                # (``store.eventlog``): a reward that committed before it is seen here, and
                # one that commits after it finds these samples and holds them back itself.
                current = dict(cur.execute(
                    "SELECT stream_id, max(stream_version) FROM events"
                    " WHERE stream_id = ANY(%b::text[]) GROUP BY stream_id",
                    ([p.episode.episode_id for p in todo],),
                ).fetchall())
                runs = {p.run.run_id: p.run for p in todo}
                cur.execute(
                    "INSERT INTO runs (run_id, project, group_size, max_negatives_per_group,"
                    " save_negative_samples, config, created_at)"
                    " SELECT * FROM unnest(%b::text[], %b::text[], %b::int[], %b::int[],"
                    " %b::boolean[], %b::jsonb[], %b::timestamptz[])"
                    " ON CONFLICT (run_id) DO NOTHING",
                    _columns([(r.run_id, r.project, r.group_size, r.max_negatives_per_group,
                               r.save_negative_samples, Jsonb(r.config), r.created_at)
                              for r in runs.values()], 7),
                )
                again = [p.episode.episode_id for p in todo if p.episode.episode_id in done]
                samples = [_sample_values(s, _sample_status(p, current))
                           for p in todo for s in p.samples]
                kept: list[tuple[Any, ...]] = []
                if again:
                    # Stale and skipped samples are made again with their state; leased and
                    # consumed ones stay exactly as they are (a trainer has them); ready and
                    # no_reward ones take the state this projection gives them.
                    kept = cur.execute(
                        "SELECT episode_id, kind, timeline_index, status, lease_id, leased_until,"
                        " consumed_version FROM samples WHERE episode_id = ANY(%b::text[])"
                        " AND status IN ('stale', 'skipped')",
                        (again,),
                    ).fetchall()
                    for table in ("timeline_forks", "failures", "tool_calls"):
                        cur.execute(f"DELETE FROM {table} WHERE episode_id = ANY(%b::text[])",
                                    (again,))
                    cur.execute("DELETE FROM samples WHERE episode_id = ANY(%b::text[])"
                                f" AND status NOT IN {_PROTECTED}", (again,))
                cur.execute(_EPISODE_UPSERT,
                            _row_columns([p.episode for p in todo], _EPISODE_TYPES))
                if again:
                    made = [(s.episode_id, s.kind, s.timeline_index)
                            for p in todo if p.episode.episode_id in done for s in p.samples]
                    cur.execute(_DELETE_CONFLICTS, [again, *_columns(made, 3)])
                if samples:
                    cur.execute(_SAMPLE_INSERT_KEEPING if again else _SAMPLE_INSERT,
                                _columns(samples, 22))
                if kept:
                    cur.execute(
                        "UPDATE samples s SET status = k.status, lease_id = k.lease_id,"
                        " leased_until = k.leased_until, consumed_version = k.consumed_version"
                        " FROM unnest(%b::text[], %b::text[], %b::int[], %b::text[], %b::uuid[],"
                        " %b::timestamptz[], %b::int[])"
                        " AS k(episode_id, kind, timeline_index, status, lease_id, leased_until,"
                        " consumed_version)"
                        " WHERE s.episode_id = k.episode_id AND s.kind = k.kind"
                        " AND s.timeline_index = k.timeline_index",
                        _columns(kept, 7),
                    )
                for statement, types, rows in (
                        (_FORK_INSERT, _FORK_TYPES, [f for p in todo for f in p.forks]),
                        (_TOOL_CALL_INSERT, _TOOL_CALL_TYPES,
                         [t for p in todo for t in p.tool_calls]),
                        (_FAILURE_INSERT, _FAILURE_TYPES, [f for p in todo for f in p.failures])):
                    if rows:
                        cur.execute(statement, _row_columns(rows, types))
                # Every statement executed (their errors raised) before the hook runs.
                pipeline.sync()
                if before_commit is not None:
                    before_commit()
        written = {id(p) for p in todo}
        return [id(p) in written for p in projections]

    def finished_unprojected(self, limit: int = 100) -> list[str]:
        """Episodes whose ``episode_finished`` is stored but whose projection is missing or
        older than their last event (a lost replay message, a broker that was down, a late
        reward not projected yet)."""
        with self.db.connection() as conn:
            rows = conn.execute(
                """
                SELECT f.stream_id FROM events f
                LEFT JOIN episodes p ON p.episode_id = f.stream_id
                WHERE f.type = 'episode_finished'
                  AND (p.episode_id IS NULL OR p.projected_version < f.stream_version
                       OR p.projected_version < (SELECT max(l.stream_version) FROM events l
                                                 WHERE l.stream_id = f.stream_id))
                ORDER BY f.position
                LIMIT %s
                """,
                (limit,),
            ).fetchall()
        return [r[0] for r in rows]

    def checkpoint(self, name: str) -> LogPosition | None:
        """Where the subscriber ``name`` has got to in the log."""
        with self.db.connection() as conn:
            row = conn.execute(
                "SELECT tx_id, position FROM projection_checkpoints WHERE name = %s", (name,)
            ).fetchone()
        return None if row is None else LogPosition(row[0], row[1])

    def save_checkpoint(self, name: str, position: LogPosition) -> None:
        with self.db.transaction() as conn:
            conn.execute(
                "INSERT INTO projection_checkpoints (name, tx_id, position) VALUES (%s,%s,%s)"
                " ON CONFLICT (name) DO UPDATE SET tx_id = excluded.tx_id,"
                " position = excluded.position, updated_at = now()",
                (name, position.tx_id, position.position),
            )

    def rebuild(self) -> int:
        """Empty the projections so that replaying the log rebuilds them. Samples a trainer
        leased, acknowledged, skipped or found stale are kept, with their episode rows (marked
        unprojected: ``projected_version`` 0), so that the replay keeps their state, and never
        changes or deletes a leased or consumed one (it records a conflict instead). Returns
        the number of samples kept. Only DELETE is used, so the app's role may run it."""
        with self.db.transaction() as conn:
            conn.execute("LOCK TABLE episodes, samples, timeline_forks, failures, tool_calls,"
                         " runs, projection_checkpoints IN ACCESS EXCLUSIVE MODE")
            for table in ("timeline_forks", "failures", "tool_calls"):
                conn.execute(f"DELETE FROM {table}")
            conn.execute("DELETE FROM samples WHERE status IN ('ready', 'no_reward')")
            kept = int(scalar(conn, "SELECT count(*) FROM samples"))
            conn.execute("DELETE FROM episodes e WHERE NOT EXISTS"
                         " (SELECT 1 FROM samples s WHERE s.episode_id = e.episode_id)")
            conn.execute("UPDATE episodes SET projected_version = 0")
            conn.execute("DELETE FROM runs")
            conn.execute("DELETE FROM projection_checkpoints")
        return kept

    def conflict_count(self) -> int:
        """How many projection conflicts are recorded."""
        with self.db.connection() as conn:
            return int(scalar(conn, "SELECT count(*) FROM projection_conflicts"))

    def conflicts(self, *, episode_id: str | None = None, run_id: str | None = None,
                  limit: int = 100) -> list[dict[str, Any]]:
        """The latest projection conflicts, newest first (optionally of one episode or run):
        what a re-projection wanted to do to a leased or consumed sample and did not do.
        Raises ValueError when ``limit`` is not a positive integer."""
        whole_number("limit", limit)
        with self.db.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            return cur.execute(
                "SELECT recorded_at, episode_id, run_id, kind, timeline_index, sample_id,"
                " sample_status, action, columns, projected_version FROM projection_conflicts"
                " WHERE (%(e)s::text IS NULL OR episode_id = %(e)s)"
                " AND (%(r)s::text IS NULL OR run_id = %(r)s)"
                " ORDER BY recorded_at DESC, conflict_id DESC LIMIT %(n)s",
                {"e": episode_id, "r": run_id, "n": limit},
            ).fetchall()

    def restore_kept_state(self) -> int:
        """After a rebuild's replays: give samples back the lease state that a rebuild of an
        earlier version set aside in ``sample_state_kept`` (today's ``rebuild`` keeps such
        samples in place, and this finds nothing to do)."""
        with self.db.transaction() as conn:
            exists = scalar(conn, "SELECT to_regclass('sample_state_kept')")
            if exists is None:
                return 0
            n = conn.execute(
                "UPDATE samples s SET status = k.status, lease_id = k.lease_id,"
                " leased_until = k.leased_until, consumed_version = k.consumed_version"
                " FROM sample_state_kept k WHERE s.episode_id = k.episode_id"
                " AND s.kind = k.kind AND s.timeline_index = k.timeline_index"
            ).rowcount
            conn.execute("DROP TABLE sample_state_kept")
        return n
