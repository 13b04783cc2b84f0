"""What processes that follow the event log keep in the database: a durable cursor each, and
a lock that lets one of several copies lead.

A follower reads the log in commit order (``EventStore.subscribe``), acts on each event, and
saves the position it acted up to (``save_cursor``). Several copies may run (one per replay
worker); ``leadership`` lets exactly one act at a time, and the others take over when its
connection goes (a process that dies releases its session lock with its connection).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import psycopg

from store.db import translate_errors
from store.eventlog import EventStore
from store.rows import LogPosition, safe_data

__all__ = ["NO_REPLAY", "REPLAY_FOLLOWER", "ReplayDue", "due_replays", "leader_present",
           "leadership", "load_cursor", "not_projected", "save_cursor", "unprojected_page",
           "unprojected_replays"]

#: The follower that queues (or runs) the replay of every finished episode: the replay
#: workers' dispatcher, and ``trajstore serve``'s own unless it runs with ``--no-replay``.
REPLAY_FOLLOWER = "replay-dispatch"

#: What is wrong, and how to fix it, when no process leads ``REPLAY_FOLLOWER``: the words of
#: ``trajstore serve --no-replay``'s start-up warning and of ``/ready``.
NO_REPLAY = ("no process replays finished episodes: what is ingested is stored but never "
             "becomes samples. Start a replay worker (`trajstore worker --queues replay`, or "
             "`trajstore up`), or run `trajstore serve` without --no-replay")


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not 0 < len(name) <= 200:
        raise ValueError(f"a follower's name is 1 to 200 characters, got {name!r}")


def load_cursor(store: EventStore, name: str) -> LogPosition | None:
    """The position follower ``name`` has acted up to, or None when it never saved one."""
    _check_name(name)
    with store.db.connection() as conn:
        row = conn.execute("SELECT tx_id, position FROM log_followers WHERE name = %s",
                           (name,)).fetchone()
    return None if row is None else LogPosition(int(row[0]), int(row[1]))


def save_cursor(store: EventStore, name: str, position: LogPosition) -> None:
    """Record that follower ``name`` has acted on every event up to ``position``. A position
    behind the saved one is ignored (a follower never goes back)."""
    _check_name(name)
    with store.db.connection() as conn:
        conn.execute(
            """
            INSERT INTO log_followers (name, tx_id, position) VALUES (%s, %s, %s)
            ON CONFLICT (name) DO UPDATE
               SET tx_id = excluded.tx_id, position = excluded.position, updated_at = now()
             WHERE (log_followers.tx_id, log_followers.position)
                   < (excluded.tx_id, excluded.position)
            """,
            (name, position.tx_id, position.position),
        )


def _lock_key(name: str) -> int:
    _check_name(name)
    return zlib.crc32(f"trajstore.follower.{name}".encode())


def leader_present(store: EventStore, name: str) -> bool:
    """Whether some process leads follower ``name`` now (holds its lock, ``leadership``)."""
    # A one-argument advisory lock on a key below 2**32 shows in pg_locks with classid 0,
    # objid the key and objsubid 1.
    with store.db.connection() as conn:
        row = conn.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            " AND classid = 0 AND objid = %s::bigint::oid AND objsubid = 1)",
            (_lock_key(name),)).fetchone()
    return row is not None and bool(row[0])


@contextmanager
def leadership(store: EventStore, name: str) -> Iterator[bool]:
    """Try to become the one active copy of follower ``name``: yields True while this
    process holds the lock (a session advisory lock on a connection of its own, held until
    the block ends or the process dies), False when another copy holds it."""
    key = _lock_key(name)
    with translate_errors():
        conn = psycopg.connect(store.db.url, autocommit=True)
    try:
        with translate_errors():
            row = conn.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()
            held = row is not None and bool(row[0])
        yield held
    finally:
        conn.close()


def not_projected(store: EventStore, appended: Sequence[tuple[str, int]]) -> list[str]:
    """Of ``(episode_id, stream_version)`` pairs (an ``episode_finished``, or a late
    ``reward_assigned``, and its version), the finished episodes whose projection is missing
    or older than that version, each once, in the order given. A reward of an episode not
    finished yet is left out: the episode is projected when it finishes."""
    if not appended:
        return []
    ids = [episode_id for episode_id, _ in appended]
    versions = [version for _, version in appended]
    with store.db.connection() as conn:
        rows = conn.execute(
            "SELECT u.e FROM unnest(%s::text[], %s::int[]) WITH ORDINALITY AS u(e, v, n)"
            " WHERE EXISTS (SELECT 1 FROM events f WHERE f.stream_id = u.e"
            "               AND f.type = 'episode_finished' AND f.stream_version <= u.v)"
            " AND NOT EXISTS (SELECT 1 FROM episodes p WHERE p.episode_id = u.e"
            "                 AND p.projected_version >= u.v)"
            " ORDER BY u.n",
            (ids, versions)).fetchall()
    return list(dict.fromkeys(r[0] for r in rows))


@dataclass(frozen=True)
class ReplayDue:
    """A finished episode whose projection is missing or older than ``version``: the stream
    version of the event that made its replay due (its ``episode_finished``, or a late
    ``reward_assigned``), and ``project`` the project of its run (``default`` for a run that
    names none, or an episode whose run has no ``run_created``)."""

    episode_id: str
    version: int
    project: str


# The project of the episode u.e: its first event's run, that run's run_created.
_PROJECT = (
    "coalesce((SELECT " + safe_data("r.data") + "->>'project' FROM events s"
    " JOIN events r ON r.stream_id = 'run-' || s.run_id AND r.stream_version = 1"
    " AND r.type = 'run_created' WHERE s.stream_id = u.e AND s.stream_version = 1),"
    " 'default')")


def due_replays(store: EventStore, appended: Sequence[tuple[str, int]]) -> list[ReplayDue]:
    """:func:`not_projected` with each episode's project and the last version given for it,
    in one query (the replay dispatcher's batch: each replay is queued within its project's
    budget)."""
    if not appended:
        return []
    last: dict[str, int] = {}
    for episode_id, version in appended:
        last[episode_id] = max(version, last.get(episode_id, version))
    with store.db.connection() as conn:
        rows = conn.execute(
            f"SELECT u.e, u.v, {_PROJECT}"
            " FROM unnest(%s::text[], %s::int[]) WITH ORDINALITY AS u(e, v, n)"
            " WHERE EXISTS (SELECT 1 FROM events f WHERE f.stream_id = u.e"
            "               AND f.type = 'episode_finished' AND f.stream_version <= u.v)"
            " AND NOT EXISTS (SELECT 1 FROM episodes p WHERE p.episode_id = u.e"
            "                 AND p.projected_version >= u.v)"
            " ORDER BY u.n",
            (list(last), list(last.values()))).fetchall()
    return [ReplayDue(r[0], int(r[1]), str(r[2])) for r in rows]


def unprojected_replays(store: EventStore, limit: int = 200) -> list[ReplayDue]:
    """Up to ``limit`` finished episodes whose projection is missing or older than their last
    event, oldest finish first (``Projections.finished_unprojected``), each with its last
    version and its project: what the sweep projects when no replay of it is on its way."""
    return unprojected_page(store, limit)[0]


def unprojected_page(store: EventStore, limit: int = 200, *, after: int | None = None
                     ) -> tuple[list[ReplayDue], int | None]:
    """:func:`unprojected_replays` whose ``episode_finished`` lies past log position ``after``
    (None: from the start), and the position to pass as ``after`` for the next page (None
    when this page is the last: fewer than ``limit`` found). Paging on from page to page reads
    every finished episode once. ValueError for a ``limit`` below 1."""
    if limit < 1:
        raise ValueError(f"a page holds at least one episode, got limit={limit}")
    with store.db.connection() as conn:
        rows = conn.execute(
            f"SELECT u.e, u.v, {_PROJECT}, u.n FROM ("
            "  SELECT f.stream_id AS e, f.position AS n,"
            "         (SELECT max(l.stream_version) FROM events l"
            "           WHERE l.stream_id = f.stream_id) AS v,"
            "         p.projected_version AS pv"
            "    FROM events f LEFT JOIN episodes p ON p.episode_id = f.stream_id"
            "   WHERE f.type = 'episode_finished' AND f.position > %s) u"
            " WHERE u.pv IS NULL OR u.pv < u.v"
            " ORDER BY u.n LIMIT %s",
            (-1 if after is None else after, limit)).fetchall()
    due = [ReplayDue(r[0], int(r[1]), str(r[2])) for r in rows]
    return due, (int(rows[-1][3]) if len(rows) == limit else None)
