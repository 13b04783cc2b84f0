"""Leasing complete GRPO groups to trainers.

A lease holds whole groups only: ``group_size`` episodes of the group projected (aborted
and invalid ones do not count), with their positive samples and the group's negatives up to
the run's cap (earliest failure first; the rest are marked ``skipped``). Samples are locked with
``SELECT … FOR UPDATE SKIP LOCKED`` and a group is taken only when every one of its ready
samples was locked here, so two trainers never get the same sample. A lease that is neither
acknowledged nor released before it expires gives its samples back (``expire``, run by every
``lease_batch``), so a trainer that dies loses nothing; ``ack`` after that raises
``LeaseExpired`` rather than letting the samples count twice.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from psycopg.rows import dict_row

from store import errors
from store.codec import unpack_mask
from store.db import scalar
from store.eventlog import EventStore, run_stream_id
from store.events import failure_order_key
from store.lease_expiry import expire_overdue
from store.rows import safe_data
from store.stored_sample import StoredSample, from_row

__all__ = ["Lease", "LeasedSample", "LeaseExpired", "Leasing", "expire_overdue"]


class LeaseExpired(errors.StoreError):
    """The lease ended (expired or released) before this call; its samples went back."""


@dataclass(frozen=True)
class LeasedSample(StoredSample):
    """A stored sample as leasing hands it to a trainer: its ``reward`` is always a number
    (the latest reward of its episode, or the run's negative reward), never None."""

    reward: float


@dataclass(frozen=True)
class Lease:
    lease_id: uuid.UUID
    run_id: str
    groups: list[str]
    expires_at: dt.datetime
    samples: list[LeasedSample] = field(default_factory=list)
    skipped_stale: int = 0
    #: Set when the samples are rows of this dataset version (a trainer taking a dataset,
    #: ``workers.trainer.dataset_source``): nothing is leased in the database, so there is
    #: nothing to acknowledge, renew or release.
    dataset_id: int | None = None


def _sample(row: dict[str, Any]) -> LeasedSample:
    """A leased sample from its row. Every leased sample has a reward: samples without one
    are ``no_reward`` and never leased; a row that has none is refused, never made a
    number."""
    if row["reward"] is None:
        raise errors.StoreError(f"sample {row['sample_id']} was leased without a reward; "
                                "samples of unrewarded episodes are never ready")
    mask = unpack_mask(row["loss_mask"])
    return from_row(row, as_type=LeasedSample, reward=float(row["reward"]), status="leased",
                    loss_mask=mask, num_trainable=int(np.count_nonzero(mask)))


class Leasing:
    """Leases, acknowledgements and expiry over one store's ``samples`` table."""

    def __init__(self, store: EventStore) -> None:
        self.db = store.db

    def current_policy_version(self, run_id: str) -> int:
        """The newest ``policy_updated`` version of the run (0 when it has none)."""
        with self.db.connection() as conn:
            return int(scalar(
                conn,
                f"SELECT coalesce(max(({safe_data('data')}->>'version')::int), 0) FROM events"
                " WHERE stream_id = %s AND type = 'policy_updated'",
                (run_stream_id(run_id),),
            ))

    def expire(self, *, now: dt.datetime | None = None) -> int:
        """Give the samples of every lease past its expiry back to ``ready``; returns how
        many samples went back. Expiry is judged by the database's clock, or as of ``now``
        when given (a timezone-aware time: tests and tools look ahead without waiting)."""
        if now is not None and now.tzinfo is None:
            raise ValueError("now must be timezone-aware")
        with self.db.transaction() as conn:
            return expire_overdue(conn, now=now)

    def lease_batch(
        self,
        run_id: str,
        *,
        groups: int,
        lease_seconds: float,
        max_staleness: int | None = None,
        current_version: int | None = None,
        trainer: str | None = None,
        prepare: Callable[[Lease], None] | None = None,
    ) -> Lease | None:
        """Lease up to ``groups`` complete groups of ``run_id`` for ``lease_seconds``.

        ``prepare`` (for example building the response that reports the lease) is called
        with the lease before its transaction commits: whatever it raises rolls the lease
        back, so no sample stays leased for an answer that was never given.

        Returns None when no complete group is ready. With ``max_staleness`` set, groups whose
        oldest sample was generated more than that many policy versions before
        ``current_version`` (default: the run's newest) are marked ``stale``, never leased,
        and counted in ``skipped_stale``. Raises ``ValidationError`` for non-positive
        ``groups`` or ``lease_seconds`` or a negative ``max_staleness``.
        """
        if groups < 1:
            raise errors.ValidationError(f"groups must be >= 1, got {groups}", field="groups")
        if not lease_seconds > 0:
            raise errors.ValidationError(f"lease_seconds must be > 0, got {lease_seconds}",
                                         field="lease_seconds")
        if max_staleness is not None and max_staleness < 0:
            raise errors.ValidationError(f"max_staleness must be >= 0, got {max_staleness}",
                                         field="max_staleness")
        self.expire()
        if max_staleness is not None and current_version is None:
            current_version = self.current_policy_version(run_id)
        lease_id = uuid.uuid4()
        with self.db.transaction() as conn:
            run = conn.execute(
                "SELECT group_size, max_negatives_per_group FROM runs WHERE run_id = %s",
                (run_id,),
            ).fetchone()
            if run is None:
                return None
            group_size, max_negatives = run
            # Complete groups with ready samples, oldest finished first.
            candidates = conn.execute(
                """
                WITH ready AS (
                    SELECT DISTINCT group_id FROM samples
                    WHERE run_id = %(run)s AND status = 'ready'
                )
                SELECT e.group_id, min(e.policy_version), max(e.finished_at)
                FROM episodes e JOIN ready USING (group_id)
                WHERE e.run_id = %(run)s
                GROUP BY e.group_id
                -- a group is complete when group_size of its episodes finished, could be
                -- replayed and are rewarded: aborted and invalid episodes do not count, nor
                -- do episodes without a reward or whose late reward is not projected yet
                -- (their samples wait as no_reward)
                HAVING count(*) FILTER (
                           WHERE e.status NOT IN ('aborted', 'invalid')
                             AND e.reward IS NOT NULL
                             AND NOT EXISTS (SELECT 1 FROM samples w
                                             WHERE w.episode_id = e.episode_id
                                               AND w.status = 'no_reward'))
                       >= %(n)s
                ORDER BY 3, 1
                LIMIT %(limit)s
                """,
                {"run": run_id, "n": group_size, "limit": max(4 * groups, 32)},
            ).fetchall()
            stale_groups = []
            fresh = []
            for group_id, version, _ in candidates:
                if (max_staleness is not None and version is not None
                        and version < current_version - max_staleness):  # type: ignore[operator]
                    stale_groups.append(group_id)
                else:
                    fresh.append(group_id)
            skipped_stale = 0
            if stale_groups:
                skipped_stale = conn.execute(
                    "UPDATE samples SET status = 'stale' WHERE run_id = %s"
                    " AND group_id = ANY(%s) AND status = 'ready'",
                    (run_id, stale_groups),
                ).rowcount
            if not fresh:
                return Lease(lease_id, run_id, [], dt.datetime.now(dt.UTC),
                             skipped_stale=skipped_stale) if skipped_stale else None
            # Lock what no other trainer holds; SKIP LOCKED never waits on another lease.
            locked = conn.execute(
                """
                SELECT sample_id, group_id, kind, failed_at, episode_id, failure_version
                FROM samples
                WHERE run_id = %s AND group_id = ANY(%s) AND status = 'ready'
                ORDER BY group_id, sample_id
                FOR UPDATE SKIP LOCKED
                """,
                (run_id, fresh),
            ).fetchall()
            # A statement that starts after the locks were granted: every ready sample of a
            # group we may take. A group is ours only if we locked all of them.
            ready_counts = dict(conn.execute(
                "SELECT group_id, count(*) FROM samples WHERE run_id = %s"
                " AND group_id = ANY(%s) AND status = 'ready' GROUP BY group_id",
                (run_id, fresh),
            ).fetchall())
            by_group: dict[str, list[tuple[Any, ...]]] = {}
            for row in locked:
                by_group.setdefault(row[1], []).append(row)
            taken: list[str] = []
            leased_ids: list[int] = []
            skipped_ids: list[int] = []
            for group_id in fresh:
                rows = by_group.get(group_id, [])
                if not rows or len(rows) != ready_counts.get(group_id, -1):
                    continue
                positives = [r[0] for r in rows if r[2] == "positive"]
                negatives = sorted((r for r in rows if r[2] == "negative"),
                                   key=lambda r: failure_order_key(r[4], r[5]))
                leased_ids += positives + [r[0] for r in negatives[:max_negatives]]
                skipped_ids += [r[0] for r in negatives[max_negatives:]]
                taken.append(group_id)
                if len(taken) == groups:
                    break
            if not taken:
                return Lease(lease_id, run_id, [], dt.datetime.now(dt.UTC),
                             skipped_stale=skipped_stale) if skipped_stale else None
            expires_at = scalar(conn, "SELECT now() + make_interval(secs => %s)",
                                (lease_seconds,))
            if skipped_ids:
                conn.execute("UPDATE samples SET status = 'skipped' WHERE sample_id = ANY(%s)",
                             (skipped_ids,))
            conn.execute(
                "UPDATE samples SET status = 'leased', lease_id = %s, leased_until = %s"
                " WHERE sample_id = ANY(%s)",
                (lease_id, expires_at, leased_ids),
            )
            conn.execute(
                "INSERT INTO leases (lease_id, run_id, trainer, groups, samples, expires_at)"
                " VALUES (%s, %s, %s, %s, %s, %s)",
                (lease_id, run_id, trainer, taken, len(leased_ids), expires_at),
            )
            # The batch's row order is a function of what was played, not of ids drawn at
            # random or of timing (a run with a seed trains the same mini-batches twice):
            # by policy version and task of the episode, then group, kind, episode, index.
            leased = conn.cursor(row_factory=dict_row, binary=True).execute(
                "SELECT s.sample_id, s.run_id, s.group_id, s.episode_id, s.agent, s.kind,"
                " s.reward, s.policy_version, s.prompt_length, s.token_ids, s.loss_mask,"
                " s.logprobs FROM samples s JOIN episodes e ON e.episode_id = s.episode_id"
                " WHERE s.lease_id = %s ORDER BY e.policy_version, e.task_id, s.group_id,"
                " s.kind DESC, s.episode_id, s.timeline_index",
                (lease_id,),
            ).fetchall()
            lease = Lease(lease_id, run_id, taken, expires_at, [_sample(r) for r in leased],
                          skipped_stale=skipped_stale)
            if prepare is not None:
                prepare(lease)
        return lease

    def _end(self, conn: Any, lease_id: uuid.UUID, how: str) -> tuple[Any, ...]:
        row = conn.execute(
            "SELECT ended, samples FROM leases WHERE lease_id = %s FOR UPDATE", (lease_id,)
        ).fetchone()
        if row is None:
            raise errors.NotFoundError(f"no lease {lease_id}")
        if row[0] is not None and row[0] != how:
            raise LeaseExpired(f"lease {lease_id} already ended: {row[0]}")
        return row

    def ack(self, lease_id: uuid.UUID, *, policy_version: int) -> int:
        """Mark the lease's samples consumed by ``policy_version``. Acknowledging twice is
        harmless (returns the same count). Raises ``LeaseExpired`` when the lease expired or
        was released first, ``NotFoundError`` for an unknown lease."""
        with self.db.transaction() as conn:
            ended, count = self._end(conn, lease_id, "acked")
            if ended == "acked":
                return count
            n = conn.execute(
                "UPDATE samples SET status = 'consumed', consumed_version = %s,"
                " leased_until = NULL WHERE lease_id = %s AND status = 'leased'",
                (policy_version, lease_id),
            ).rowcount
            conn.execute(
                "UPDATE leases SET ended = 'acked', ended_at = now(), policy_version = %s"
                " WHERE lease_id = %s",
                (policy_version, lease_id),
            )
        return n

    def release(self, lease_id: uuid.UUID) -> int:
        """Give the lease's samples back to ``ready`` untrained. Releasing twice is harmless;
        raises ``LeaseExpired`` when the lease was acknowledged or expired first."""
        with self.db.transaction() as conn:
            ended, _ = self._end(conn, lease_id, "released")
            if ended == "released":
                return 0
            n = conn.execute(
                "UPDATE samples SET status = 'ready', lease_id = NULL, leased_until = NULL"
                " WHERE lease_id = %s AND status = 'leased'",
                (lease_id,),
            ).rowcount
            conn.execute(
                "UPDATE leases SET ended = 'released', ended_at = now() WHERE lease_id = %s",
                (lease_id,),
            )
        return n

    def renew(self, lease_id: uuid.UUID, lease_seconds: float) -> dt.datetime:
        """Extend a live lease to ``lease_seconds`` from now; ``LeaseExpired`` when it ended."""
        with self.db.transaction() as conn:
            ended, _ = self._end(conn, lease_id, "")
            expires_at = scalar(
                conn,
                "UPDATE leases SET expires_at = now() + make_interval(secs => %s)"
                " WHERE lease_id = %s RETURNING expires_at",
                (lease_seconds, lease_id),
            )
            conn.execute("UPDATE samples SET leased_until = %s WHERE lease_id = %s"
                         " AND status = 'leased'", (expires_at, lease_id))
        return expires_at

    def stats(self, run_id: str) -> dict[str, int]:
        """Samples of the run by status (every status present, zero when none)."""
        with self.db.connection() as conn:
            rows = conn.execute(
                "SELECT status, count(*) FROM samples WHERE run_id = %s GROUP BY status",
                (run_id,),
            ).fetchall()
        out = dict.fromkeys(("ready", "leased", "consumed", "stale", "skipped", "no_reward"),
                            0)
        out.update({status: n for status, n in rows})
        return out
