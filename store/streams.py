"""Several streams read with one query: what replay reads for a batch of episodes.

``EventStore.read_stream`` reads one stream per round trip; projecting hundreds of episodes
at a time wants their events, and their runs' ``run_created``, in one query each.
"""

from __future__ import annotations

from collections.abc import Sequence

import psycopg
from psycopg.rows import dict_row

from store.eventlog import EventStore, RecordedEvent, run_stream_id
from store.rows import ROW_COLUMNS, Decoder

__all__ = ["read_run_events", "read_streams"]


def _read_events(store: EventStore, stream_ids: Sequence[str], where: str, *,
                 conn: psycopg.Connection | None = None) -> list[RecordedEvent]:
    """The events of ``stream_ids`` that ``where`` (SQL after the stream filter) keeps,
    decoded as ``EventStore.read_stream`` gives them (token payloads and delta encodings
    expanded; ``llm_called`` rows checked as a trusted ``Decoder`` checks them), read with
    one query (on ``conn`` when given)."""
    if not stream_ids:
        return []
    if conn is None:
        with store.db.connection() as own:
            return _read_events(store, stream_ids, where, conn=own)
    rows = conn.cursor(row_factory=dict_row, binary=True).execute(
        f"SELECT {ROW_COLUMNS} FROM events WHERE stream_id = ANY(%b::text[]) {where}",
        (list(stream_ids),),
    ).fetchall()
    # The log's own rows, checked on append: not validated again (see ``Decoder``).
    decoder = Decoder(trusted=True)
    return [decoder.decode(row) for row in rows]


def read_streams(store: EventStore, stream_ids: Sequence[str], *,
                 conn: psycopg.Connection | None = None, llm_calls: bool = True
                 ) -> dict[str, list[RecordedEvent]]:
    """Every event of each stream, in version order, by stream id (a stream with no events
    is absent), read with one query on ``conn`` (a connection of ``store.db``) when given.
    ``llm_calls`` False leaves the ``llm_called`` events out (most of a stream's bytes)."""
    out: dict[str, list[RecordedEvent]] = {}
    where = "" if llm_calls else "AND type <> 'llm_called' "
    for event in _read_events(store, stream_ids, where + "ORDER BY stream_id, stream_version",
                              conn=conn):
        out.setdefault(event.stream_id, []).append(event)
    return out


def read_run_events(store: EventStore, run_ids: set[str], *,
                    conn: psycopg.Connection | None = None) -> dict[str, RecordedEvent]:
    """The first event of each run's stream (its ``run_created``), by run id; an unknown
    run is absent."""
    wanted = {run_stream_id(run_id): run_id for run_id in run_ids}
    return {wanted[event.stream_id]: event
            for event in _read_events(store, list(wanted), "AND stream_version = 1",
                                      conn=conn)}
