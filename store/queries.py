"""Read queries beyond the recorder's own reads, as functions taking the store (an
``EventStore``, or any ``store.recorder.Recorder``): the lookups of runs and episodes, the
listings of the API (episodes, runs, groups, samples), the sweep's stale episodes, the demo's
per-version table and the readiness probe. The code outside ``store/`` calls these and writes
no SQL.

Episodes are listed from the log (``episode_started`` rows, in start order) joined with the
replay projection where it exists, so an episode shows up as soon as it starts; status and
reward come from the projection when the episode was replayed and from its events
otherwise. Pages are cut by the start event's position (a keyset cursor: stable while new
episodes arrive, no OFFSET scans).
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from psycopg.rows import dict_row

from store import errors
from store.events import EpisodeStarted, RunCreated
from store.recorder import Recorder
from store.rows import ROW_COLUMNS, Decoder, RecordedEvent, safe_data
from store.stream_rules import run_stream_id

__all__ = [
    "EpisodeCall",
    "EpisodeFilters",
    "EpisodeSummary",
    "SampleFilters",
    "VersionSummary",
    "counts_by_type",
    "created_runs",
    "episode_summaries",
    "get_episode",
    "get_run",
    "episodes_done",
    "failures_by_version",
    "negatives_trained_by_version",
    "ping",
    "idle_remote_rollouts",
    "stale_episodes",
    "version_summaries",
    "episode_finished",
    "episode_calls",
    "episode_row",
    "episode_run",
    "episode_sampling_params",
    "iter_episode_starts",
    "iter_samples",
    "span_call_stored",
    "stored_event_ids",
    "lease_run",
    "list_episodes",
    "list_runs",
    "list_samples",
    "run_episode_counts",
    "run_groups",
    "run_ids_of",
    "run_record",
    "stream_event_rows",
]


def counts_by_type(store: Recorder) -> dict[str, int]:
    """Number of stored events of each type (a type never stored is absent)."""
    with store.db.connection() as conn:
        rows = conn.execute("SELECT type, count(*) FROM events GROUP BY type").fetchall()
    return {t: n for t, n in rows}


def get_run(store: Recorder, run_id: str) -> RunCreated:
    """The ``run_created`` event of a run; ``NotFoundError`` when there is none."""
    events = store.read_stream(run_stream_id(run_id), to_version=1)
    if not events or not isinstance(events[0].event, RunCreated):
        raise errors.NotFoundError(f"no run {run_id!r}")
    return events[0].event


def created_runs(store: Recorder) -> list[RecordedEvent]:
    """Every run's ``run_created`` event, decoded, oldest first (``list_runs`` gives one
    project's runs as rows)."""
    with store.db.connection() as conn:
        cur = conn.cursor(row_factory=dict_row, binary=True)
        rows = cur.execute(
            f"SELECT {ROW_COLUMNS} FROM events WHERE type = 'run_created' ORDER BY position"
        ).fetchall()
    decoder = Decoder()
    return [decoder.decode(r) for r in rows]


def get_episode(store: Recorder, episode_id: str) -> list[RecordedEvent]:
    """Every event of an episode, decoded, in version order; ``NotFoundError`` when the
    stream is empty or is not an episode."""
    events = store.read_stream(episode_id)
    if not events or not isinstance(events[0].event, EpisodeStarted):
        raise errors.NotFoundError(f"no episode {episode_id!r}")
    return events


@dataclass(frozen=True)
class EpisodeFilters:
    """Filters of an episode listing; None means "any". ``run_ids`` is required (the runs
    the caller may see). ``reward_min``/``reward_max`` are inclusive; ``started_after`` is
    inclusive and ``started_before`` exclusive; ``branched_from`` an episode id: the
    episodes branched from it (``episode_started.branched_from.episode_id``)."""

    run_ids: Sequence[str]
    group_id: str | None = None
    status: str | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    policy_version: int | None = None
    error_type: str | None = None
    tool_name: str | None = None
    started_after: dt.datetime | None = None
    started_before: dt.datetime | None = None
    branched_from: str | None = None


# Field extraction through safe_data: a row stored with a NUL escape must not break listings.
_F_DATA, _R_DATA, _S_DATA, _T_DATA, _DATA = (
    safe_data(c) for c in ("f.data", "r.data", "s.data", "t.data", "data"))

_STATUS = f"""coalesce(p.status,
                (SELECT {_F_DATA}->>'status' FROM events f
                  WHERE f.stream_id = s.stream_id AND f.type = 'episode_finished' LIMIT 1),
                'running')"""
_REWARD = f"""coalesce(p.reward,
                (SELECT ({_R_DATA}->>'value')::float8 FROM events r
                  WHERE r.stream_id = s.stream_id AND r.type = 'reward_assigned'
                  ORDER BY r.stream_version DESC LIMIT 1))"""
_POLICY = f"coalesce(p.policy_version, ({_S_DATA}->>'policy_version')::int)"

_EPISODE_SELECT = f"""
SELECT s.position, s.stream_id AS episode_id, s.run_id, s.group_id, s.recorded_at AS started_at,
       {_S_DATA}->>'task_id' AS task_id, {_POLICY} AS policy_version,
       {_S_DATA}->'branched_from' AS branched_from,
       {_STATUS} AS status,
       {_REWARD} AS reward,
       (SELECT max(v.stream_version) FROM events v WHERE v.stream_id = s.stream_id) AS events,
       p.finished_at, p.invalid_reason, p.projected_version, p.llm_calls, p.tool_calls,
       p.tool_errors, p.attempts_failed, p.rollbacks, p.timelines, p.survivors, p.forks,
       p.drifted_messages, p.negatives, p.tokens
FROM events s
LEFT JOIN episodes p ON p.episode_id = s.stream_id
"""

_ERROR_TYPE = f"""
EXISTS (SELECT 1 FROM events t WHERE t.stream_id = s.stream_id
        AND ((t.type = 'tool_returned' AND {_T_DATA}->>'error_type' = %(error_type)s)
          OR (t.type = 'attempt_failed' AND EXISTS (
                SELECT 1 FROM json_array_elements_text({_T_DATA}->'error_types') x(v)
                WHERE x.v = %(error_type)s))))
"""

_TOOL_NAME = f"""
EXISTS (SELECT 1 FROM events t WHERE t.stream_id = s.stream_id
        AND t.type = 'tool_returned' AND {_T_DATA}->>'name' = %(tool_name)s)
"""


def list_episodes(store: Recorder, filters: EpisodeFilters, *, after: int = 0,
                  limit: int = 100) -> list[dict[str, Any]]:
    """One page of episodes matching ``filters`` whose start position is past ``after``, in
    start order (dicts of the columns of ``_EPISODE_SELECT``). Raises ValueError for a
    ``limit`` below 1; an empty ``run_ids`` gives no episodes."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if not filters.run_ids:
        return []
    # Walk the episode starts in position order (events_episodes_idx for one run) and test
    # each against the filters, so that a page costs about its own rows, not the run's.
    where = ["s.type = 'episode_started'", "s.position > %(after)s"]
    params: dict[str, Any] = {"after": after, "limit": limit}
    if len(filters.run_ids) == 1:
        where.append("s.run_id = %(run)s")
        params["run"] = filters.run_ids[0]
    else:
        where.append("s.run_id = ANY(%(runs)s)")
        params["runs"] = list(filters.run_ids)
    conditions = (
        ("group_id", "s.group_id = %(group)s", "group"),
        ("started_after", "s.recorded_at >= %(t0)s", "t0"),
        ("started_before", "s.recorded_at < %(t1)s", "t1"),
        ("status", f"{_STATUS} = %(status)s", "status"),
        ("reward_min", f"{_REWARD} >= %(rmin)s", "rmin"),
        ("reward_max", f"{_REWARD} <= %(rmax)s", "rmax"),
        ("policy_version", f"{_POLICY} = %(pv)s", "pv"),
        ("error_type", _ERROR_TYPE, "error_type"),
        ("tool_name", _TOOL_NAME, "tool_name"),
        ("branched_from", f"{_S_DATA}->'branched_from'->>'episode_id' = %(parent)s", "parent"),
    )
    for name, sql, param in conditions:
        value = getattr(filters, name)
        if value is not None:
            where.append(sql)
            params[param] = value
    sql = f"{_EPISODE_SELECT} WHERE {' AND '.join(where)} ORDER BY s.position LIMIT %(limit)s"
    with store.db.connection() as conn:
        return conn.cursor(row_factory=dict_row).execute(sql, params).fetchall()


@dataclass(frozen=True, slots=True)
class EpisodeSummary:
    """One episode as ``episode_summaries`` lists it (the columns of ``list_episodes`` that
    every episode has)."""

    episode_id: str
    run_id: str
    group_id: str | None
    started_at: dt.datetime
    status: str
    reward: float | None
    events: int


def episode_summaries(store: Recorder, run_id: str, *, group_id: str | None = None
                      ) -> list[EpisodeSummary]:
    """Every episode of ``run_id`` (of one group when ``group_id`` is given) in start order,
    with its status and reward as ``list_episodes`` gives them: the replay projection's once
    the episode is replayed, its events' before (``running`` until ``episode_finished``). An
    unknown run has none."""
    filters = EpisodeFilters(run_ids=[run_id], group_id=group_id)
    out: list[EpisodeSummary] = []
    after = 0
    while page := list_episodes(store, filters, after=after, limit=1000):
        out += [EpisodeSummary(episode_id=r["episode_id"], run_id=r["run_id"],
                               group_id=r["group_id"], started_at=r["started_at"],
                               status=r["status"], reward=r["reward"], events=r["events"])
                for r in page]
        after = page[-1]["position"]
    return out


def episode_row(store: Recorder, episode_id: str) -> dict[str, Any] | None:
    """The listing row of one episode (None when there is no such episode)."""
    with store.db.connection() as conn:
        return conn.cursor(row_factory=dict_row).execute(
            _EPISODE_SELECT + " WHERE s.stream_id = %s AND s.stream_version = 1"
            " AND s.type = 'episode_started'",
            (episode_id,),
        ).fetchone()


def episode_sampling_params(store: Recorder, episode_ids: Sequence[str]
                            ) -> dict[str, dict[str, Any]]:
    """The ``sampling_params`` each episode's ``episode_started`` recorded (temperature,
    top_p, … as the client or the agent loop wrote them; ``{}`` when it recorded none), by
    episode id, in one query. Ids that are not episodes are left out; a recorded value that
    is not an object reads as ``{}``."""
    ids = sorted({str(e) for e in episode_ids})
    if not ids:
        return {}
    with store.db.connection() as conn:
        rows = conn.execute(
            f"SELECT s.stream_id, {_S_DATA}->'sampling_params' FROM events s"
            " WHERE s.stream_id = ANY(%s) AND s.stream_version = 1"
            " AND s.type = 'episode_started'", (ids,)).fetchall()
    return {stream: value if isinstance(value, dict) else {} for stream, value in rows}


def episode_run(store: Recorder, episode_id: str) -> str | None:
    """The run an episode belongs to (None: no such episode)."""
    with store.db.connection() as conn:
        row = conn.execute(
            "SELECT run_id FROM events WHERE stream_id = %s AND stream_version = 1"
            " AND type = 'episode_started'",
            (episode_id,),
        ).fetchone()
    return None if row is None else row[0]


def lease_run(store: Recorder, lease_id: uuid.UUID) -> str | None:
    """The run of a lease (None: no such lease)."""
    with store.db.connection() as conn:
        row = conn.execute("SELECT run_id FROM leases WHERE lease_id = %s",
                           (lease_id,)).fetchone()
    return None if row is None else row[0]


def run_record(store: Recorder, run_id: str) -> dict[str, Any] | None:
    """The run's ``run_created`` data with its time and stream version (None: no run)."""
    with store.db.connection() as conn:
        return conn.cursor(row_factory=dict_row).execute(
            "SELECT r.run_id, r.data, r.recorded_at AS created_at,"
            " (SELECT max(v.stream_version) FROM events v WHERE v.stream_id = r.stream_id)"
            " AS version"
            " FROM events r WHERE r.stream_id = %s AND r.stream_version = 1"
            " AND r.type = 'run_created'",
            (run_stream_id(run_id),),
        ).fetchone()


def list_runs(store: Recorder, project: str) -> list[dict[str, Any]]:
    """Every run of ``project``, oldest first (run_id, data, created_at)."""
    with store.db.connection() as conn:
        return conn.cursor(row_factory=dict_row).execute(
            "SELECT run_id, data, recorded_at AS created_at FROM events"
            f" WHERE type = 'run_created' AND {_DATA}->>'project' = %s ORDER BY position",
            (project,),
        ).fetchall()


def run_ids_of(store: Recorder, project: str) -> list[str]:
    """The ids of every run of ``project``."""
    with store.db.connection() as conn:
        rows = conn.execute(
            f"SELECT run_id FROM events WHERE type = 'run_created' AND {_DATA}->>'project'"
            " = %s",
            (project,),
        ).fetchall()
    return [r[0] for r in rows]


def run_episode_counts(store: Recorder, run_id: str) -> dict[str, int]:
    """Episodes of a run: ``started`` (from the log) and, per status, those replayed."""
    with store.db.connection() as conn:
        row = conn.execute(
            "SELECT count(*) FROM events WHERE run_id = %s AND type = 'episode_started'",
            (run_id,),
        ).fetchone()
        started = int(row[0]) if row is not None else 0
        rows = conn.execute(
            "SELECT status, count(*) FROM episodes WHERE run_id = %s GROUP BY status",
            (run_id,),
        ).fetchall()
    out = {"started": started}
    out.update({status: n for status, n in rows})
    return out


def run_groups(store: Recorder, run_id: str, *, limit: int = 1000) -> list[dict[str, Any]]:
    """The groups of a run in the order their first episode started, at most ``limit``:
    ``group_id``, ``episodes`` started, ``replayed`` (projected), ``completed``,
    ``mean_reward`` over replayed episodes with a reward, the lowest and highest
    ``policy_version``, ``tool_errors``, ``rollbacks`` and ``negatives`` summed over the
    replayed episodes. Raises ValueError for a ``limit`` below 1."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    with store.db.connection() as conn:
        return conn.cursor(row_factory=dict_row).execute(
            f"""SELECT s.group_id, count(*) AS episodes, count(p.episode_id) AS replayed,
                       count(*) FILTER (WHERE p.status = 'completed') AS completed,
                       avg(p.reward) AS mean_reward,
                       min({_POLICY}) AS min_version, max({_POLICY}) AS max_version,
                       coalesce(sum(p.tool_errors), 0) AS tool_errors,
                       coalesce(sum(p.rollbacks), 0) AS rollbacks,
                       coalesce(sum(p.negatives), 0) AS negatives,
                       min(s.recorded_at) AS started_at
                FROM events s LEFT JOIN episodes p ON p.episode_id = s.stream_id
                WHERE s.run_id = %(run)s AND s.type = 'episode_started'
                GROUP BY s.group_id ORDER BY min(s.position) LIMIT %(limit)s""",
            {"run": run_id, "limit": limit},
        ).fetchall()


@dataclass(frozen=True)
class SampleFilters:
    """Filters of a sample listing or export; None means "any"."""

    run_id: str
    group_id: str | None = None
    kind: str | None = None
    status: str | None = None


_SAMPLE_COLUMNS = (
    "sample_id, run_id, group_id, episode_id, agent, kind, status, reward, policy_version,"
    " prompt_length, num_tokens, num_trainable, timeline_index, position_key, retry_index,"
    " error_types, error_messages"
)
_TOKEN_COLUMNS = ", token_ids, loss_mask, logprobs"


def _sample_where(filters: SampleFilters) -> tuple[str, dict[str, Any]]:
    where = ["run_id = %(run)s"]
    params: dict[str, Any] = {"run": filters.run_id}
    for name, column in (("group_id", "group_id"), ("kind", "kind"), ("status", "status")):
        value = getattr(filters, name)
        if value is not None:
            where.append(f"{column} = %({name})s")
            params[name] = value
    return " AND ".join(where), params


def list_samples(store: Recorder, filters: SampleFilters, *, after: int = 0,
                 limit: int = 100, tokens: bool = True) -> list[dict[str, Any]]:
    """One page of samples (by ``sample_id`` past ``after``), with their token columns
    (raw little-endian bytes) when ``tokens``. Raises ValueError for ``limit`` below 1."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    where, params = _sample_where(filters)
    params.update(after=after, limit=limit)
    columns = _SAMPLE_COLUMNS + (_TOKEN_COLUMNS if tokens else "")
    with store.db.connection() as conn:
        return conn.cursor(row_factory=dict_row, binary=True).execute(
            f"SELECT {columns} FROM samples WHERE {where} AND sample_id > %(after)s"
            " ORDER BY sample_id LIMIT %(limit)s",
            params,
        ).fetchall()


def iter_samples(store: Recorder, filters: SampleFilters, *, chunk: int = 256
                 ) -> Iterator[list[dict[str, Any]]]:
    """Every matching sample with its tokens, in ``sample_id`` order, ``chunk`` rows at a
    time from a server-side cursor: memory stays at one chunk however large the run. The
    connection is held until the iterator is exhausted or closed."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    where, params = _sample_where(filters)
    with store.db.transaction() as conn:
        cur = conn.cursor(name=f"export_{uuid.uuid4().hex[:12]}", row_factory=dict_row,
                          binary=True)
        cur.itersize = chunk
        cur.execute(f"SELECT {_SAMPLE_COLUMNS}{_TOKEN_COLUMNS} FROM samples WHERE {where}"
                    " ORDER BY sample_id", params)
        while rows := cur.fetchmany(chunk):
            yield rows
        cur.close()


def iter_episode_starts(store: Recorder, run_id: str, *, finished_only: bool = False,
                        min_reward: float | None = None, chunk: int = 256
                        ) -> Iterator[list[dict[str, Any]]]:
    """The episodes of a run in start order, ``chunk`` at a time: ``episode_id``,
    ``group_id``, ``data`` (the ``episode_started`` data: task_id, messages, tools, …),
    ``started_at``, ``status`` and ``reward`` (as in the episode listing). With
    ``finished_only`` running episodes are left out; with ``min_reward`` so is every episode
    whose reward is unknown or below it (inclusive bound)."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    where = ["s.run_id = %(run)s", "s.type = 'episode_started'", "s.position > %(after)s"]
    params: dict[str, Any] = {"run": run_id, "limit": chunk}
    if finished_only:
        where.append(f"{_STATUS} <> 'running'")
    if min_reward is not None:
        where.append(f"{_REWARD} >= %(rmin)s")
        params["rmin"] = min_reward
    sql = (f"SELECT s.position, s.stream_id AS episode_id, s.group_id, {_S_DATA} AS data,"
           f" s.recorded_at AS started_at, {_STATUS} AS status, {_REWARD} AS reward"
           " FROM events s LEFT JOIN episodes p ON p.episode_id = s.stream_id"
           f" WHERE {' AND '.join(where)} ORDER BY s.position LIMIT %(limit)s")
    after = 0
    while True:
        with store.db.connection() as conn:
            rows = conn.cursor(row_factory=dict_row).execute(
                sql, {**params, "after": after}).fetchall()
        if not rows:
            return
        yield rows
        after = rows[-1]["position"]


def episode_finished(store: Recorder, episode_id: str) -> bool:
    """Whether the episode's ``episode_finished`` is stored."""
    with store.db.connection() as conn:
        row = conn.execute(
            "SELECT EXISTS (SELECT 1 FROM events WHERE stream_id = %s"
            " AND type = 'episode_finished')",
            (episode_id,),
        ).fetchone()
    return bool(row is not None and row[0])


@dataclass(frozen=True)
class EpisodeCall:
    """One ``llm_called`` of an episode without its payloads: its call id, agent, the number
    of assistant messages in its request (its turn) and whether a ``rolled_back`` discarded
    it."""

    call_id: str
    agent: str
    turn: int
    discarded: bool


def episode_calls(store: Recorder, episode_id: str) -> list[EpisodeCall]:
    """The episode's LLM calls in recording order (see ``EpisodeCall``)."""
    with store.db.connection() as conn:
        rows = conn.execute(
            f"SELECT type, {_DATA}->>'call_id', {_DATA}->>'agent',"
            f" (SELECT count(*) FROM json_array_elements("
            f"   CASE WHEN json_typeof({_DATA}->'messages') = 'array'"
            f"   THEN {_DATA}->'messages' ELSE '[]'::json END) m"
            f"  WHERE m->>'role' = 'assistant'),"
            f" CASE WHEN type = 'rolled_back' THEN {_DATA}->'discarded_call_ids' END"
            " FROM events WHERE stream_id = %s AND type IN ('llm_called', 'rolled_back')"
            " ORDER BY stream_version",
            (episode_id,),
        ).fetchall()
    discarded = {str(c) for r in rows if r[0] == "rolled_back" for c in (r[4] or [])}
    return [EpisodeCall(call_id=r[1], agent=r[2] or "main", turn=int(r[3]),
                        discarded=r[1] in discarded)
            for r in rows if r[0] == "llm_called"]


def stream_event_rows(store: Recorder, stream_id: str) -> list[dict[str, Any]]:
    """A stream's events without their token payloads, in version order: position,
    stream_version, type, schema_version, event_id, data (as stored), occurred_at,
    recorded_at. Cheaper than ``EventStore.read_stream`` when no tokens are wanted (no
    payload decoding, no models built)."""
    with store.db.connection() as conn:
        return conn.cursor(row_factory=dict_row).execute(
            "SELECT position, stream_version, type, schema_version, event_id, data,"
            " occurred_at, recorded_at FROM events WHERE stream_id = %s"
            " ORDER BY stream_version",
            (stream_id,),
        ).fetchall()


def stored_event_ids(store: Recorder, event_ids: Sequence[uuid.UUID]) -> set[uuid.UUID]:
    """Which of ``event_ids`` the log holds already (in any stream)."""
    if not event_ids:
        return set()
    with store.db.connection() as conn:
        rows = conn.execute("SELECT event_id FROM events WHERE event_id = ANY(%s)",
                            (list(event_ids),)).fetchall()
    return {row[0] for row in rows}


def foreign_event_ids(store: Recorder, event_ids: Sequence[uuid.UUID], project: str
                      ) -> set[uuid.UUID]:
    """Which of ``event_ids`` the log holds in a run of a project other than ``project``."""
    if not event_ids:
        return set()
    with store.db.connection() as conn:
        rows = conn.execute(
            "SELECT e.event_id FROM events e JOIN events r"
            " ON r.stream_id = 'run-' || e.run_id AND r.stream_version = 1"
            " AND r.type = 'run_created'"
            " WHERE e.event_id = ANY(%s)"
            " AND coalesce(r.data->>'project', 'default') <> %s",
            (list(event_ids), project)).fetchall()
    return {row[0] for row in rows}


def stored_tool_calls(store: Recorder, event_ids: Sequence[uuid.UUID]
                      ) -> dict[uuid.UUID, tuple[str, dict[str, Any]]]:
    """The tool name and arguments of the ``tool_returned`` events the log holds under
    ``event_ids`` (ids of other events, or of none, are absent)."""
    if not event_ids:
        return {}
    with store.db.connection() as conn:
        rows = conn.execute(
            "SELECT event_id, data->>'name', data->'arguments' FROM events"
            " WHERE event_id = ANY(%s) AND type = 'tool_returned'",
            (list(event_ids),)).fetchall()
    return {row[0]: (row[1], row[2] if isinstance(row[2], dict) else {}) for row in rows}


def span_call_stored(store: Recorder, event_id: uuid.UUID) -> bool | None:
    """What the log holds under ``event_id``: None when nothing; True when an
    ``llm_called`` recorded from an OTLP span (its response carries ``otlp``); False when
    any other event."""
    with store.db.connection() as conn:
        row = conn.execute(
            "SELECT type = 'llm_called' AND (data->'response'->'otlp') IS NOT NULL "
            "FROM events WHERE event_id = %s", (event_id,)).fetchone()
    return None if row is None else bool(row[0])


def ping(store: Recorder) -> None:
    """One round trip to the database. Raises ``store.errors.StoreError`` (a
    ``TransientError`` when it is unreachable)."""
    with store.db.connection() as conn:
        conn.execute("SELECT 1").fetchone()


def _check_idle(timeout_s: float, limit: int, now: dt.datetime | None) -> None:
    """The arguments of the idle-episode queries: a positive timeout, a ``limit`` of at
    least 1, a timezone-aware ``now`` (or None: the database's clock)."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if now is not None and now.tzinfo is None:
        raise ValueError("now must be timezone-aware")
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")


def stale_episodes(store: Recorder, *, timeout_s: float, limit: int = 200,
                   now: dt.datetime | None = None) -> list[tuple[str, int]]:
    """Episodes with no ``episode_finished`` and no event for ``timeout_s`` seconds, oldest
    start first, at most ``limit``: ``(episode_id, last stream_version)``. Time is the
    database's clock, or ``now`` when given (timezone-aware). Raises ValueError for a
    non-positive timeout, a ``limit`` below 1 or a naive ``now``."""
    _check_idle(timeout_s, limit, now)
    with store.db.connection() as conn:
        rows = conn.execute(
            """
            SELECT s.stream_id, max(e.stream_version)
            FROM events s
            JOIN events e ON e.stream_id = s.stream_id
            WHERE s.type = 'episode_started'
              AND NOT EXISTS (SELECT 1 FROM events f WHERE f.stream_id = s.stream_id
                                                        AND f.type = 'episode_finished')
            GROUP BY s.stream_id
            HAVING max(e.recorded_at) < coalesce(%s, now()) - make_interval(secs => %s)
            ORDER BY min(s.position)
            LIMIT %s
            """,
            (now, timeout_s, limit),
        ).fetchall()
    return [(stream_id, int(version)) for stream_id, version in rows]


def idle_remote_rollouts(store: Recorder, *, timeout_s: float, limit: int = 200,
                         now: dt.datetime | None = None) -> list[tuple[str, int, bool]]:
    """Remote rollouts (episodes with an ``llm_called`` that carries a ``mask_check``) with
    no ``episode_finished`` and no event for ``timeout_s`` seconds, oldest first, at most
    ``limit``: ``(episode_id, last stream_version, whether the last call made tool calls)``.
    Time as in ``stale_episodes``; the same ValueErrors."""
    _check_idle(timeout_s, limit, now)
    last_calls = f"{safe_data('l.data')}->'response'->'tool_calls'"
    with store.db.connection() as conn:
        rows = conn.execute(
            f"""
            SELECT s.stream_id, max(e.stream_version),
                   coalesce((SELECT CASE WHEN json_typeof({last_calls}) = 'array'
                                         THEN json_array_length({last_calls}) > 0
                                         ELSE false END
                               FROM events l
                              WHERE l.stream_id = s.stream_id AND l.type = 'llm_called'
                              ORDER BY l.stream_version DESC LIMIT 1), false)
            FROM events s
            JOIN events e ON e.stream_id = s.stream_id
            WHERE s.type = 'episode_started'
              AND NOT EXISTS (SELECT 1 FROM events f WHERE f.stream_id = s.stream_id
                                                        AND f.type = 'episode_finished')
              AND EXISTS (SELECT 1 FROM events m WHERE m.stream_id = s.stream_id
                            AND m.type = 'llm_called'
                            AND {safe_data('m.data')}->'response'->'mask_check' IS NOT NULL)
            GROUP BY s.stream_id
            HAVING max(e.recorded_at) < coalesce(%s, now()) - make_interval(secs => %s)
            ORDER BY min(s.position)
            LIMIT %s
            """,
            (now, timeout_s, limit),
        ).fetchall()
    return [(stream_id, int(version), bool(tools)) for stream_id, version, tools in rows]


@dataclass(frozen=True)
class VersionSummary:
    """The replayed episodes of one policy version of a run (aborted and invalid ones left
    out): how many, their mean reward, and the sums of their tool calls, tool errors,
    rollbacks and negative samples."""

    version: int
    episodes: int
    reward_mean: float
    tool_calls: int
    tool_errors: int
    rollbacks: int
    negatives: int


def version_summaries(store: Recorder, run_id: str) -> list[VersionSummary]:
    """One summary per policy version of ``run_id`` that has replayed episodes, in version
    order (an unknown run has none)."""
    with store.db.connection() as conn:
        rows = conn.execute(
            "SELECT policy_version, count(*), avg(reward), sum(tool_calls), sum(tool_errors),"
            " sum(rollbacks), sum(negatives) FROM episodes WHERE run_id = %s"
            " AND status NOT IN ('aborted', 'invalid') AND policy_version IS NOT NULL"
            " GROUP BY policy_version ORDER BY policy_version", (run_id,)).fetchall()
    return [VersionSummary(int(v), int(n), float(r or 0.0), int(tc or 0), int(te or 0),
                           int(rb or 0), int(ng or 0)) for v, n, r, tc, te, rb, ng in rows]


def negatives_trained_by_version(store: Recorder, run_id: str) -> dict[int, int]:
    """Negative samples of ``run_id`` a trainer consumed (leased and acknowledged), by the
    policy version that played them (an unknown run has none)."""
    with store.db.connection() as conn:
        rows = conn.execute(
            "SELECT policy_version, count(*) FROM samples WHERE run_id = %s"
            " AND kind = 'negative' AND status = 'consumed' AND policy_version IS NOT NULL"
            " GROUP BY 1", (run_id,)).fetchall()
    return {int(version): int(n) for version, n in rows}


def failures_by_version(store: Recorder, run_id: str) -> dict[int, dict[str, int]]:
    """Failures of ``run_id`` counted by policy version and error type (``unknown`` when the
    failure has none)."""
    with store.db.connection() as conn:
        rows = conn.execute(
            "SELECT policy_version, coalesce(error_type, 'unknown'), count(*) FROM failures"
            " WHERE run_id = %s AND policy_version IS NOT NULL GROUP BY 1, 2",
            (run_id,)).fetchall()
    out: dict[int, dict[str, int]] = {}
    for version, kind, n in rows:
        out.setdefault(int(version), {})[kind] = int(n)
    return out


def episodes_done(store: Recorder, run_id: str, version: int | None = None) -> int:
    """Replayed episodes of ``run_id`` at policy ``version`` (every version when None;
    aborted and invalid ones left out)."""
    with store.db.connection() as conn:
        row = conn.execute(
            "SELECT count(*) FROM episodes WHERE run_id = %s"
            " AND (%s::int IS NULL OR policy_version = %s)"
            " AND status NOT IN ('aborted', 'invalid')", (run_id, version, version)).fetchone()
    return int(row[0]) if row else 0
