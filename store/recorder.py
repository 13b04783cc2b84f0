"""The recorder: every append to the events table and every read of it, and the only code
that writes events.

Three ways in share one set of rules: ``append`` (one batch, one transaction),
``append_many`` (many streams' batches in one transaction, checked and written set-wise) and,
above it, ``EventStore.aappend`` (coroutines' appends gathered by ``store.append_batcher``).
The hard parts, each commented where it happens:
- idempotent append keyed by ``event_id`` (``_append_in``, ``_INSERT``),
- optimistic concurrency on stream versions, under a per-stream lock (``_append_in``),
- the stream rules asked under that lock of the state ``_STATE_COLUMNS`` reads
  (``store.stream_rules``: closed episodes, event order, runs' streams),
- gap-free reading in commit order (``read_all``),
- prompt delta encoding (``store.rows.encode_llm_call``, decoded by ``store.rows.Decoder``).
Events become rows and rows events in ``store.rows``; driver errors become ``store.errors``
in ``store.db``.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Histogram
from psycopg.rows import dict_row

from store import errors
from store.db import (
    BinaryArray,
    Database,
    NotBinary,
    bytea_array,
    int2_array,
    int4_array,
    scalar,
    text_array,
    timestamptz_array,
    translate_errors,
    uuid_array,
)
from store.events import EpisodeStarted, Event, LLMCalled, RunCreated
from store.lease_expiry import expire_overdue
from store.rows import (
    ROW_COLUMNS,
    START,
    Decoder,
    EventRow,
    LLMCallMemory,
    LogPosition,
    RecordedEvent,
    data_json,
    encode_llm_call,
    same_content,
    stored_size,
)
from store.settings import Settings
from store.stream_rules import (
    ANY,
    ExpectedVersion,
    StreamState,
    check_append,
    check_expected_version,
    rewards_only,
)
from store.validation import check_text, validate_batch

__all__ = ["APPEND_LATENCY", "AppendResult", "Recorder"]

#: Append durations of this process (seconds), observed by every append path; in no registry
#: until ``store.metrics.registry`` adds it.
APPEND_LATENCY = Histogram(
    "trajstore_append_seconds", "Append latency in this process.", registry=None,
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0))


@dataclass(frozen=True, slots=True)
class AppendResult:
    """Where an append's events sit. ``duplicate`` is True when every event id was already
    stored (an idempotent retry): nothing new was written and the original positions are
    returned."""

    stream_id: str
    positions: tuple[int, ...]
    version: int
    duplicate: bool = False


_INSERT = """
INSERT INTO events (event_id, stream_id, stream_version, type, schema_version, run_id,
                    group_id, agent, data, prompt_ids, prompt_base_version,
                    prompt_prefix_len, prompt_len, response_ids, logprobs, occurred_at)
SELECT u.event_id, u.stream_id, u.stream_version, u.type, u.schema_version, u.run_id,
       u.group_id, u.agent, u.data::json, u.prompt_ids, u.prompt_base_version,
       u.prompt_prefix_len, u.prompt_len, u.response_ids, u.logprobs, u.occurred_at
FROM unnest(%b::uuid[], %b::text[], %b::int4[], %b::text[], %b::int2[], %b::text[],
            %b::text[], %b::text[], %b::text[], %b::bytea[], %b::int4[], %b::int4[],
            %b::int4[], %b::bytea[], %b::bytea[], %b::timestamptz[])
     WITH ORDINALITY AS u(event_id, stream_id, stream_version, type, schema_version, run_id,
                          group_id, agent, data, prompt_ids, prompt_base_version,
                          prompt_prefix_len, prompt_len, response_ids, logprobs, occurred_at, n)
ORDER BY u.n
-- Idempotency: a concurrent append of the same event ids makes these rows conflict on
-- event_id. Naming the column (not a bare ON CONFLICT DO NOTHING) keeps a clash on
-- (stream_id, stream_version), a genuine version conflict, an error.
ON CONFLICT (event_id) DO NOTHING
RETURNING event_id, position
"""

# append_many's INSERT of many batches: without ON CONFLICT, all rows or an error. Each row
# comes back by its (stream, version), which it alone holds: cheaper to read than its id,
# which the driver makes into a uuid.UUID in Python.
_INSERT_TOGETHER = (_INSERT[: _INSERT.index("-- Idempotency")]
                    + "RETURNING stream_id, stream_version, position\n")

# append_many's locks: one per stream, taken in the order of the (sorted) array, as a
# function scan returns it; a second lock on a colliding hash is granted at once.
_LOCK_STREAMS = (
    "SELECT pg_advisory_xact_lock(hashtextextended(u.s, 0)) FROM unnest(%s::text[]) AS u(s)"
)

# The columns of a stream's StreamState (store.stream_rules), for the stream named u.s: what
# every append path reads of a stream under its lock before asking the rules. A fact the
# rules come to need is one more column here and one more field of StreamState.
_STATE_COLUMNS = (
    "coalesce((SELECT max(e.stream_version) FROM events e WHERE e.stream_id = u.s), 0)",
    "EXISTS (SELECT 1 FROM events e WHERE e.stream_id = u.s AND e.type = 'episode_finished')",
)

# _append_in's read of its one stream's state.
_STREAM_STATE = f"SELECT {', '.join(_STATE_COLUMNS)} FROM (SELECT %s::text) AS u(s)"

# Every stream's state, as _append_in reads it one by one, and then the ids of the batches
# that are stored already (NULL stream, id last): one statement, so one command of the round
# trip fewer than two; both reads start after the locks.
_STREAM_STATES = f"""
SELECT u.s, {', '.join(_STATE_COLUMNS)}, NULL::uuid
FROM unnest(%s::text[]) AS u(s)
UNION ALL
SELECT NULL, {', '.join(['NULL'] * len(_STATE_COLUMNS))}, e.event_id
FROM events e WHERE e.event_id = ANY(%s)
"""


class Recorder:
    """Appends to and reads from the events table of one PostgreSQL database.

    Thread-safe: connections come from the database's pool; what the recorder remembers of
    recent streams (their run and group, their last LLM calls as delta bases) is behind a
    lock. ``EventStore`` (``store.eventlog``) is the recorder as processes open it.
    """

    def __init__(self, database: Database, settings: Settings | None = None) -> None:
        self.db = database
        self.settings = settings or Settings()
        self._calls: OrderedDict[str, list[LLMCallMemory]] = OrderedDict()
        self._stream_meta: OrderedDict[str, tuple[str | None, str | None]] = OrderedDict()
        self._cache_lock = threading.Lock()

    # --- append ----------------------------------------------------------------------------

    def append(
        self,
        stream_id: str,
        events: Sequence[Event],
        expected_version: ExpectedVersion = ANY,
    ) -> AppendResult:
        """Append ``events`` to ``stream_id`` atomically, all or nothing.

        ``expected_version`` is the version the stream must be at (0 or ``NO_STREAM``: the
        stream must not exist; ``ANY``: no check). A stale one raises ``ConflictError`` with
        the current version. Events without an ``event_id`` get a new one. Appending event
        ids that are all stored already with the same content is an idempotent retry: nothing
        is written and the original positions come back (``duplicate=True``), whatever
        ``expected_version`` says. The same id with other content raises
        ``IdempotencyError``; a batch mixing stored and new ids raises ``ValidationError``.
        Invalid events raise ``ValidationError`` naming the event index and field.
        """
        expected, events = self._prepare(stream_id, events, expected_version)
        started = time.perf_counter()
        for attempt in range(5):
            try:
                result = self._append_once(stream_id, events, expected)
                APPEND_LATENCY.observe(time.perf_counter() - started)
                return result
            except (_Retry, errors.DuplicateKeyError):
                if attempt == 4:
                    raise errors.TransientError(
                        f"append to {stream_id!r} kept racing with concurrent appends"
                    ) from None
        raise AssertionError("unreachable")

    def append_many(
        self, batches: Sequence[tuple[str, Sequence[Event], ExpectedVersion]]
    ) -> list[AppendResult | Exception]:
        """Append several ``(stream_id, events, expected_version)`` batches in one
        transaction: one commit for all of them (what concurrent episodes' appends share).

        Each batch keeps :meth:`append`'s meaning and answers on its own: the list holds, in
        order, its ``AppendResult`` or the exception :meth:`append` would have raised for it
        (``ConflictError``, ``ClosedError``, ``ValidationError``…); a failing batch leaves
        the others stored. Streams are locked in sorted order, so concurrent callers never
        deadlock. The batches are checked and written set-wise: one round trip locks every
        stream and reads their versions and the ids already stored, one ``INSERT`` writes
        every batch that passed; a batch that is a retry (ids already stored) or a stream's
        second batch runs after it on its own, under a savepoint. When the set-wise insert
        cannot go through (a row raced in, the database refused a value) the transaction is
        undone and every batch runs again on its own under its savepoint. A batch that races
        with a concurrent append of the same ids is run again on its own after the commit.
        Raises only for what stops the whole transaction (``TransientError`` when the
        database is unreachable).
        """
        answers: list[AppendResult | Exception | None] = [None] * len(batches)
        prepared: list[_Prepared] = []
        for index, (stream_id, events, expected_version) in enumerate(batches):
            try:
                expected, checked = self._prepare(stream_id, events, expected_version)
            except errors.StoreError as exc:
                answers[index] = exc
                continue
            prepared.append((index, stream_id, checked, expected))
        prepared.sort(key=lambda item: (item[1], item[0]))
        started = time.perf_counter()
        outcome = _Outcome()
        if prepared:
            try:
                outcome = self._append_set_wise(prepared)
            except errors.TransientError:
                raise
            except errors.StoreError:
                # Undone as a whole: each batch again under its own savepoint, which names
                # the one that failed and keeps the others.
                outcome = self._append_each(prepared)
        APPEND_LATENCY.observe(time.perf_counter() - started)
        for index, failure in outcome.failed:
            answers[index] = failure
        for index, stream_id, result, memo in outcome.done:
            if memo is not None:
                self._remember(stream_id, memo)
            answers[index] = result
        for index in outcome.again:
            stream_id, events, expected_version = batches[index]
            try:
                answers[index] = self.append(stream_id, events, expected_version)
            except errors.StoreError as exc:
                answers[index] = exc
        return [answer for answer in answers if answer is not None]

    def _append_set_wise(self, prepared: list[_Prepared]) -> _Outcome:
        """``append_many``'s transaction with two round trips for every batch that can go
        together (see there): one locks the streams and reads their state, one inserts and
        commits. Raises the ``StoreError`` of the ``INSERT`` (the transaction rolled back)
        when it cannot be written as planned."""
        streams = sorted({stream_id for _, stream_id, _, _ in prepared})
        ids = [e.event_id for _, _, events, _ in prepared for e in events]
        outcome = _Outcome()
        together: list[tuple[int, str, list[Event], list[EventRow], _Memo, int]]
        together = []
        alone: list[_Prepared] = []
        positions: dict[tuple[str, int], int] = {}
        inserted: Any = None
        # Pipeline mode: BEGIN and the two statements below go in one round trip, the
        # INSERT and COMMIT in a second. The locks are taken in the order of the (sorted)
        # array, and in READ COMMITTED the reads, which start once they are granted, see
        # every append committed before (as in _append_in).
        with self.db.connection() as conn, conn.pipeline(), conn.transaction():
            streams_param = _array_param(text_array, streams, conn)
            conn.execute(_LOCK_STREAMS, (streams_param,))
            state_rows = conn.execute(
                _STREAM_STATES, (streams_param, _array_param(uuid_array, ids, conn))
            ).fetchall()
            stored = {row[-1] for row in state_rows if row[0] is None}
            states = {row[0]: StreamState(*row[1:-1]) for row in state_rows
                      if row[0] is not None}
            seen_streams: set[str] = set()
            seen_ids: set[Any] = set()
            for item in prepared:
                index, stream_id, events, expected = item
                batch_ids = [e.event_id for e in events]
                # A retry (some ids stored), ids a batch before it also carries, or a stream
                # met before: decided against what the batches before it wrote, so written
                # after them, on its own.
                apart = stream_id in seen_streams or any(
                    i in stored or i in seen_ids for i in batch_ids)
                seen_streams.add(stream_id)
                seen_ids.update(batch_ids)
                if apart:
                    alone.append(item)
                    continue
                state = states[stream_id]
                current = state.version
                if state.finished and rewards_only(events):
                    alone.append(item)  # a late reward: checked with the samples' locks
                    continue
                try:
                    check_append(stream_id, events, state, expected)
                    rows, memo = self._rows(conn, stream_id, current, events)
                except errors.StoreError as exc:
                    outcome.failed.append((index, exc))
                    continue
                together.append((index, stream_id, events, rows, memo, current))
            if together:
                # No ON CONFLICT: an id committed meanwhile (by a writer of another stream)
                # fails the INSERT, and append_many runs every batch again on its own.
                inserted = conn.execute(_INSERT_TOGETHER, _columns(
                    [row for *_, batch_rows, _, _ in together for row in batch_rows], conn))
                if alone:  # its error, if any, is not the next batch's
                    positions = _positions(inserted.fetchall())
            self._append_apart(conn, alone, outcome)
        if together:
            positions = positions or _positions(inserted.fetchall())
            for index, stream_id, events, batch_rows, memo, current in together:
                result = AppendResult(
                    stream_id,
                    tuple(positions[stream_id, r.stream_version] for r in batch_rows),
                    current + len(events))
                outcome.done.append((index, stream_id, result, memo))
        return outcome

    def _append_each(self, prepared: list[_Prepared]) -> _Outcome:
        """``append_many``'s transaction one batch after the other, each under a savepoint."""
        outcome = _Outcome()
        with self.db.transaction() as conn:
            self._append_apart(conn, prepared, outcome)
        return outcome

    def _append_apart(self, conn: Any, prepared: list[_Prepared], outcome: _Outcome) -> None:
        for index, stream_id, events, expected in prepared:
            try:
                # A savepoint: one batch fails alone, its driver error translated.
                with translate_errors(), conn.transaction():
                    result, memo = self._append_in(conn, stream_id, events, expected)
            except (_Retry, errors.DuplicateKeyError):
                outcome.again.append(index)
            except errors.StoreError as exc:
                outcome.failed.append((index, exc))
            else:
                outcome.done.append((index, stream_id, result, memo))

    def _prepare(self, stream_id: str, events: Sequence[Event],
                 expected_version: ExpectedVersion) -> tuple[int | None, list[Event]]:
        """Check a batch before it touches the database; give its events ids."""
        if (not isinstance(stream_id, str) or not stream_id or len(stream_id) > 200
                or check_text(stream_id) is not None):
            raise errors.ValidationError(
                f"stream id must be a non-empty string of at most 200 characters without NUL "
                f"or lone surrogates, "
                f"got {stream_id!r}",
                field="stream_id",
            )
        expected = check_expected_version(expected_version)
        events = validate_batch(events, self.settings)
        return expected, [
            e if e.event_id is not None else e.model_copy(update={"event_id": uuid.uuid4()})
            for e in events
        ]

    def _append_once(
        self,
        stream_id: str,
        events: list[Event],
        expected: int | None,
    ) -> AppendResult:
        with self.db.transaction() as conn:
            result, memo = self._append_in(conn, stream_id, events, expected)
        if memo is not None:
            self._remember(stream_id, memo)
        return result

    def _append_in(
        self,
        conn: Any,
        stream_id: str,
        events: list[Event],
        expected: int | None,
    ) -> tuple[AppendResult, _Memo | None]:
        """The append on ``conn``, inside the caller's transaction: its result and the
        stream's memo to remember once committed (None for a duplicate)."""
        ids = [e.event_id for e in events]
        # One round trip (pipeline) for three statements, run in order:
        # 1. Appends to one stream take turns: under this lock the version read below
        #    stays current until commit, so concurrent appends with ANY never collide and
        #    a stale expected version is reported, not raced. (The unique (stream_id,
        #    stream_version) constraint still guards clients that bypass this code.)
        # 2./3. In READ COMMITTED each statement takes its snapshot when it starts, so
        #    these reads, which start after the lock is granted, see every append that
        #    committed before it.
        with conn.pipeline():
            conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
                         (stream_id,))
            stored_cur = conn.execute(
                "SELECT event_id, position, stream_id, stream_version"
                " FROM events WHERE event_id = ANY(%s)",
                (ids,),
            )
            state_cur = conn.execute(_STREAM_STATE, (stream_id,))
        stored = stored_cur.fetchall()
        if stored:
            return self._idempotent_result(conn, stream_id, events, stored), None
        state_row = state_cur.fetchone()
        assert state_row is not None  # one row, for the one stream
        state = StreamState(*state_row)
        current = state.version
        check_append(stream_id, events, state, expected)
        if state.finished:  # a late reward (anything else was refused above)
            hold_samples_for_reward(conn, stream_id, current)

        rows, memo = self._rows(conn, stream_id, current, events)
        # A unique violation here (the same event id committed meanwhile to another
        # stream, or a version taken by a client that skipped the lock) aborts this
        # transaction; ``append`` runs it again and the checks above then give the
        # precise answer (IdempotencyError, ConflictError, or success under ANY).
        returned = conn.execute(_INSERT, _columns(rows, conn)).fetchall()
        if len(returned) != len(rows):
            # A concurrent append of some of these event ids committed first and our rows
            # were skipped: undo ours and answer as for a retry.
            raise _Retry()
        by_id = dict(returned)
        positions = tuple(by_id[r.event_id] for r in rows)
        return AppendResult(stream_id, positions, current + len(events)), memo

    def _rows(
        self,
        conn: Any,
        stream_id: str,
        current: int,
        events: list[Event],
    ) -> tuple[list[EventRow], _Memo]:
        """The rows to insert, and what to remember of the stream once they are committed:
        its recent LLM calls including the new ones, and its identity when they open it."""
        run_id, group_id = self._stream_identity(conn, stream_id, current, events)
        calls = self._recent_calls(conn, stream_id, current) if current else []
        rows: list[EventRow] = []
        for i, event in enumerate(events):
            data = event.to_data()
            # The denormalised columns, from the fields of the events that have them. Read
            # from the field values: getattr on a pydantic model that lacks the field goes
            # through its __getattr__ and an AttributeError, the dearest step of a small
            # event's row.
            fields = event.__dict__
            row = EventRow(
                event_id=event.event_id,  # type: ignore[arg-type]
                stream_id=stream_id,
                stream_version=current + i + 1,
                type=event.type,
                schema_version=event.schema_version,
                run_id=fields.get("run_id") or run_id,
                group_id=fields.get("group_id") or group_id,
                agent=fields.get("agent"),
                data=data,
                occurred_at=event.occurred_at or dt.datetime.now(dt.UTC),
            )
            if isinstance(event, LLMCalled):
                memory = encode_llm_call(
                    row,
                    event,
                    calls[-self.settings.delta_candidates :],
                    min_prefix=self.settings.delta_min_prefix,
                )
                calls = [*calls, memory]
            try:
                row.data_json = data_json(row.data)
            except ValueError as exc:
                raise errors.ValidationError(str(exc), event_index=i) from None
            size = stored_size(row)
            if size > self.settings.max_event_bytes:
                raise errors.ValidationError(
                    f"event takes {size} bytes once stored, over the limit of "
                    f"{self.settings.max_event_bytes}",
                    event_index=i,
                )
            rows.append(row)
        opened = (rows[0].run_id, rows[0].group_id) if current == 0 else None
        return rows, _Memo(calls, opened)

    def _idempotent_result(
        self, conn: Any, stream_id: str, events: list[Event], stored: list[Any]
    ) -> AppendResult:
        """The answer to a batch some of whose event ids are stored already: the original
        positions for a faithful retry, an error otherwise. Compares the stored events with
        the submitted ones (rare, so no hash is kept on the hot path)."""
        by_id = {row[0]: row for row in stored}
        for event in events:
            row = by_id.get(event.event_id)
            if row is not None and row[2] != stream_id:
                # Another stream's event (perhaps another project's): a conflict that
                # tells nothing of it, neither its position nor its stream.
                raise errors.IdempotencyError(event.event_id, position=None)
        if len(by_id) != len(events):
            new = [i for i, e in enumerate(events) if e.event_id not in by_id]
            raise errors.ValidationError(
                f"the batch mixes {len(by_id)} events already stored with {len(new)} new "
                f"ones (first new: event {new[0]}); retry the original batch unchanged, or "
                "send the new events in a batch of their own",
                event_index=new[0],
                field="event_id",
            )
        versions = {row[3] for row in stored}
        decoded = {
            r.stream_version: r
            for r in self._read_stream_rows(conn, stream_id, min(versions), max(versions))
        }
        for event in events:
            row = by_id[event.event_id]
            if not same_content(decoded[row[3]].event, event):
                raise errors.IdempotencyError(event.event_id, position=row[1])
        return AppendResult(
            stream_id,
            tuple(by_id[e.event_id][1] for e in events),
            max(versions),
            duplicate=True,
        )

    def _remember(self, stream_id: str, memo: _Memo) -> None:
        keep = memo.calls[-self.settings.delta_candidates :]
        with self._cache_lock:
            self._calls[stream_id] = keep
            self._calls.move_to_end(stream_id)
            while len(self._calls) > 256:
                self._calls.popitem(last=False)
            if memo.opened is not None:  # what _stream_identity would read from version 1
                self._remember_identity(stream_id, memo.opened)

    def _remember_identity(self, stream_id: str, identity: tuple[str | None, str | None]
                           ) -> None:
        """Keep a stream's run and group id (``_cache_lock`` held)."""
        self._stream_meta[stream_id] = identity
        self._stream_meta.move_to_end(stream_id)
        while len(self._stream_meta) > 4096:
            self._stream_meta.popitem(last=False)

    def _stream_identity(
        self, conn: Any, stream_id: str, current: int, events: list[Event]
    ) -> tuple[str | None, str | None]:
        """run_id and group_id denormalised onto every row of a stream, taken from the
        stream's opening event (``run_created`` or ``episode_started``)."""
        for e in events:
            if isinstance(e, EpisodeStarted):
                return e.run_id, e.group_id
            if isinstance(e, RunCreated):
                return e.run_id, None
        if current == 0:
            return None, None
        with self._cache_lock:
            known = self._stream_meta.get(stream_id)
        if known is None:
            row = conn.execute(
                "SELECT run_id, group_id FROM events WHERE stream_id = %s AND stream_version = 1",
                (stream_id,),
            ).fetchone()
            known = (row[0], row[1]) if row else (None, None)
            with self._cache_lock:
                self._remember_identity(stream_id, known)
        return known

    def _recent_calls(self, conn: Any, stream_id: str, current: int) -> list[LLMCallMemory]:
        """Recent ``llm_called`` of the stream as delta candidates, from the cache when it is
        there and from the log otherwise (events never change, so a cached call stays valid;
        a stale cache only misses a better base)."""
        with self._cache_lock:
            cached = self._calls.get(stream_id)
        if cached is not None:
            return list(cached)
        rows = conn.cursor(row_factory=dict_row, binary=True).execute(
            f"SELECT {ROW_COLUMNS} FROM events WHERE stream_id = %s AND type = 'llm_called'"
            " ORDER BY stream_version",
            (stream_id,),
        ).fetchall()
        decoder = Decoder()
        for row in rows:
            decoder.remember(row)
        memories = [decoder.memory(stream_id, r["stream_version"]) for r in rows]
        return memories[-self.settings.delta_candidates :]

    # --- read ------------------------------------------------------------------------------

    def stream_version(self, stream_id: str) -> int:
        """The stream's current version (0 when it does not exist)."""
        with self.db.connection() as conn:
            return int(scalar(
                conn,
                "SELECT coalesce(max(stream_version), 0) FROM events WHERE stream_id = %s",
                (stream_id,),
            ))

    def read_stream(
        self, stream_id: str, *, from_version: int = 1, to_version: int | None = None
    ) -> list[RecordedEvent]:
        """The stream's events from ``from_version`` to ``to_version`` (inclusive), in
        version order, with token payloads decoded into numpy arrays. An unknown stream
        gives an empty list."""
        if from_version < 1:
            raise errors.ValidationError(f"from_version must be >= 1, got {from_version}")
        upper = to_version if to_version is not None else 2**31 - 1
        with self.db.connection() as conn:
            return self._read_stream_rows(conn, stream_id, from_version, upper)

    def _read_stream_rows(
        self, conn: Any, stream_id: str, from_version: int, to_version: int
    ) -> list[RecordedEvent]:
        # Delta bases may lie before from_version: read the stream's llm_called rows from its
        # start, decode them all, and hand back only the asked range.
        rows = conn.cursor(row_factory=dict_row, binary=True).execute(
            f"SELECT {ROW_COLUMNS} FROM events WHERE stream_id = %s"
            " AND stream_version <= %s AND (stream_version >= %s OR type = 'llm_called')"
            " ORDER BY stream_version",
            (stream_id, to_version, from_version),
        ).fetchall()
        decoder = Decoder()
        out = []
        for row in rows:
            decoded = decoder.decode(row)
            if row["stream_version"] >= from_version:
                out.append(decoded)
        return out

    def read_all(
        self,
        after: LogPosition | None = None,
        *,
        limit: int = 1000,
        types: Sequence[str] | None = None,
    ) -> list[RecordedEvent]:
        """Up to ``limit`` events after the checkpoint ``after`` in commit order.

        Gap-free: every event is returned exactly once across successive calls that pass the
        last returned event's ``log_position``, even with many concurrent writers. Filtering
        by ``types`` keeps that guarantee for the types asked.
        """
        if limit < 1:
            raise errors.ValidationError(f"limit must be >= 1, got {limit}")
        after = after or START
        # Why not "position > last seen": positions are handed out when a row is inserted,
        # but rows become visible when their transaction commits. A transaction that took
        # position 10 and commits after one that took 11 would be skipped by a reader that
        # already saw 11. Instead: read only rows written by transactions older than the
        # oldest transaction still running (xmin of the current snapshot: all of those have
        # ended, so no row can ever appear below that line again), and order by the writing
        # transaction first. The checkpoint is the (tx_id, position) pair.
        type_filter = "AND type = ANY(%(types)s)" if types else ""
        sql = f"""
            SELECT {ROW_COLUMNS} FROM events
            WHERE (tx_id, position) > (%(tx)s::text::xid8, %(pos)s)
              AND tx_id < pg_snapshot_xmin(pg_current_snapshot())
              {type_filter}
            ORDER BY tx_id, position
            LIMIT %(limit)s
        """
        params = {"tx": after.tx_id, "pos": after.position, "limit": limit,
                  "types": list(types) if types else None}
        with self.db.connection() as conn:
            cur = conn.cursor(row_factory=dict_row, binary=True)
            rows = cur.execute(sql, params).fetchall()
            return self._decode_with_bases(cur, rows)

    def held_back(self, after: LogPosition | None = None) -> bool:
        """Whether events committed after the checkpoint ``after`` are held back from
        ``read_all`` by a transaction still running that began before them (anywhere on the
        server: the line is the oldest transaction running): they are read once it ends,
        and no notification says when, since that transaction may append nothing."""
        after = after or START
        with self.db.connection() as conn:
            row = conn.execute(
                "SELECT EXISTS (SELECT 1 FROM events"
                " WHERE (tx_id, position) > (%s::text::xid8, %s)"
                " AND tx_id >= pg_snapshot_xmin(pg_current_snapshot()))",
                (after.tx_id, after.position)).fetchone()
        return bool(row and row[0])

    def _decode_with_bases(self, cur: Any, rows: list[dict[str, Any]]) -> list[RecordedEvent]:
        decoder = Decoder()
        missing = decoder.missing_bases(rows)
        if missing:
            streams = [s for s, _ in missing]
            versions = [v for _, v in missing]
            # Fetch each missing base and, recursively, the bases it needs.
            bases = cur.execute(
                f"""
                WITH RECURSIVE chain(stream_id, stream_version) AS (
                    SELECT * FROM unnest(%s::text[], %s::int4[])
                    UNION
                    SELECT e.stream_id, e.prompt_base_version FROM events e
                    JOIN chain c ON e.stream_id = c.stream_id
                                AND e.stream_version = c.stream_version
                    WHERE e.prompt_base_version IS NOT NULL
                )
                SELECT {ROW_COLUMNS} FROM events
                WHERE (stream_id, stream_version) IN (SELECT * FROM chain)
                ORDER BY stream_id, stream_version
                """,
                (streams, versions),
            ).fetchall()
            for row in bases:
                decoder.remember(row)
        # Within one stream, bases precede dependents in version order.
        order = sorted(range(len(rows)), key=lambda i: (rows[i]["stream_id"],
                                                        rows[i]["stream_version"]))
        decoded: list[RecordedEvent | None] = [None] * len(rows)
        for i in order:
            decoded[i] = decoder.decode(rows[i])
        return decoded  # type: ignore[return-value]


class _Retry(Exception):
    pass


@dataclass(frozen=True, slots=True)
class _Memo:
    """What an append leaves to remember of its stream once committed: the recent LLM calls
    (delta candidates) and, when it opens the stream, the stream's run and group id."""

    calls: list[LLMCallMemory]
    opened: tuple[str | None, str | None] | None


#: A batch of ``append_many`` once checked: its index, stream, events, expected version.
_Prepared = tuple[int, str, list[Event], int | None]


@dataclass(slots=True)
class _Outcome:
    """What ``append_many``'s transaction did with each batch: stored (with what to remember
    once committed), refused, or to run again after the commit."""

    done: list[tuple[int, str, AppendResult, _Memo | None]] = field(default_factory=list)
    failed: list[tuple[int, Exception]] = field(default_factory=list)
    again: list[int] = field(default_factory=list)


def hold_samples_for_reward(conn: Any, stream_id: str, current: int) -> None:
    """Before a late reward for the finished episode ``stream_id`` is appended (in the same
    transaction, under the stream's lock): refuse it when a trainer took one of the episode's
    samples, and otherwise hold its ready samples back until the projection that replays the
    reward replaces them.

    "Taken" means consumed (acknowledged after an optimizer step: trained with the reward it
    had) or leased under a lease that has not ended (a trainer holds it and expects it not to
    change under it). A lease past its expiry is expired first, as leasing would, so it
    does not block. ``SamplesTakenError`` names the samples. The projection's lock of the
    episode is taken first, so a projection being written either commits before (its samples
    are held back here) or reads this reward's version after (and writes them held back)."""
    conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 1))", (stream_id,))
    expire_overdue(conn, episode_id=stream_id)
    rows = conn.execute(
        "SELECT sample_id, kind, timeline_index, status FROM samples WHERE episode_id = %s"
        " ORDER BY sample_id FOR UPDATE",
        (stream_id,),
    ).fetchall()
    taken = [{"sample_id": r[0], "kind": r[1], "timeline_index": r[2], "status": r[3]}
             for r in rows if r[3] in ("consumed", "leased")]
    if taken:
        raise errors.SamplesTakenError(stream_id, actual=current, samples=taken)
    conn.execute("UPDATE samples SET status = 'no_reward' WHERE episode_id = %s"
                 " AND status = 'ready'", (stream_id,))


def _columns(rows: list[EventRow], conn: Any) -> tuple[Any, ...]:
    """The INSERT's 16 array parameters, in the order of its ``unnest``: built whole in the
    binary array format (``store.db``'s encoders, far cheaper than psycopg adapting every
    value) when the connection speaks UTF-8 and every value is of the expected type, the
    plain lists otherwise, which psycopg adapts (and refuses) as it always did."""
    columns: tuple[list[Any], ...] = (
        [r.event_id for r in rows],
        [r.stream_id for r in rows],
        [r.stream_version for r in rows],
        [r.type for r in rows],
        [r.schema_version for r in rows],
        [r.run_id for r in rows],
        [r.group_id for r in rows],
        [r.agent for r in rows],
        [r.data_json for r in rows],
        [r.prompt_ids for r in rows],
        [r.prompt_base_version for r in rows],
        [r.prompt_prefix_len for r in rows],
        [r.prompt_len for r in rows],
        [r.response_ids for r in rows],
        [r.logprobs for r in rows],
        [r.occurred_at for r in rows],
    )
    return _binary(conn, _ENCODERS, columns)


def _positions(returned: list[Any]) -> dict[tuple[str, int], int]:
    """_INSERT_TOGETHER's rows as {(stream, version): position}."""
    return {(stream_id, version): position for stream_id, version, position in returned}


def _array_param(encode: Callable[[Sequence[Any]], BinaryArray], values: list[Any],
                 conn: Any) -> Any:
    """``values`` as a binary array parameter (see _columns), or as the list itself for
    psycopg to adapt when the encoder does not take them."""
    return _binary(conn, (encode,), (values,))[0]


def _binary(conn: Any, encoders: Sequence[Callable[[Sequence[Any]], BinaryArray]],
            columns: tuple[list[Any], ...]) -> tuple[Any, ...]:
    """Each column built by its encoder when the connection speaks UTF-8 and every value is
    taken; else all of them as the plain lists, for psycopg to adapt (and refuse)."""
    if conn.info.encoding != "utf-8":
        return columns
    try:
        return tuple(encode(column) for encode, column in zip(encoders, columns, strict=True))
    except NotBinary:
        return columns


#: The binary encoder of each of _INSERT's columns (the types its unnest casts to).
_ENCODERS: tuple[Callable[[Sequence[Any]], BinaryArray], ...] = (
    uuid_array, text_array, int4_array, text_array, int2_array, text_array, text_array,
    text_array, text_array, bytea_array, int4_array, int4_array, int4_array, bytea_array,
    bytea_array, timestamptz_array)

