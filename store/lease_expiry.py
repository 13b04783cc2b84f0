"""Ending leases past their expiry: one statement that leasing and the late-reward check of
the recorder both run inside their own transactions (so it imports nothing of either)."""

from __future__ import annotations

import datetime as dt
from typing import Any

__all__ = ["expire_overdue"]


def expire_overdue(conn: Any, *, now: dt.datetime | None = None,
                   episode_id: str | None = None) -> int:
    """End (as ``expired``) every lease past its expiry, by the database's clock or as of
    ``now``, and give its samples back to ``ready``; with ``episode_id``, only the leases
    holding a sample of that episode. Runs on ``conn``, in the caller's transaction; returns
    how many samples went back. Leases are locked before samples, as ``ack`` does."""
    return int(conn.execute(
        """
        WITH gone AS (
            UPDATE leases SET ended = 'expired', ended_at = now()
            WHERE ended IS NULL AND expires_at < coalesce(%(now)s, now())
              AND (%(episode)s::text IS NULL OR lease_id IN (
                   SELECT lease_id FROM samples
                   WHERE episode_id = %(episode)s AND status = 'leased'))
            RETURNING lease_id
        )
        UPDATE samples SET status = 'ready', lease_id = NULL, leased_until = NULL
        WHERE status = 'leased' AND lease_id IN (SELECT lease_id FROM gone)
        """,
        {"now": now, "episode": episode_id},
    ).rowcount)
