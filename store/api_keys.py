"""The ``api_keys`` table: the SQL behind ``api.keys.KeyStore``.

Rows are plain tuples in the order of :data:`KEY_COLUMNS` (``key_id, project, role, name,
created_at, revoked_at``); :func:`key_secret_row` adds ``secret_hash, salt, hash_params``.
Hashing, parsing and caching keys are the API's business; storing them is this module's.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from store.db import Database, connect

__all__ = [
    "KEY_COLUMNS",
    "RevocationListener",
    "end_session",
    "insert_key",
    "key_revoked",
    "key_secret_row",
    "list_keys",
    "revoke_key",
    "session_ended",
]

KEY_COLUMNS = "key_id, project, role, name, created_at, revoked_at"
_CHANNEL = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def insert_key(db: Database, *, key_id: str, project: str, role: str, name: str | None,
               secret_hash: bytes, salt: bytes, hash_params: str) -> tuple[Any, ...]:
    """Store a new key; returns its row. Raises ``DuplicateKeyError`` for a key id that
    exists."""
    with db.transaction() as conn:
        row = conn.execute(
            f"INSERT INTO api_keys (key_id, project, role, name, secret_hash, salt,"
            f" hash_params) VALUES (%s, %s, %s, %s, %s, %s, %s) RETURNING {KEY_COLUMNS}",
            (key_id, project, role, name, secret_hash, salt, hash_params),
        ).fetchone()
    assert row is not None  # INSERT … RETURNING gives the row
    return tuple(row)


def list_keys(db: Database, *, project: str | None, include_revoked: bool
              ) -> list[tuple[Any, ...]]:
    """Key rows, oldest first, of one project (all when None); revoked ones only when
    ``include_revoked``."""
    with db.connection() as conn:
        rows = conn.execute(
            f"SELECT {KEY_COLUMNS} FROM api_keys"
            " WHERE (%s::text IS NULL OR project = %s) AND (%s OR revoked_at IS NULL)"
            " ORDER BY created_at, key_id",
            (project, project, include_revoked),
        ).fetchall()
    return [tuple(r) for r in rows]


def revoke_key(db: Database, key_id: str, *, channel: str) -> tuple[Any, ...] | None:
    """Mark a key revoked (a second revocation keeps the first time) and notify ``channel``
    with its id when the transaction commits. Returns its row, or None for an unknown id."""
    with db.transaction() as conn:
        row = conn.execute(
            f"UPDATE api_keys SET revoked_at = coalesce(revoked_at, now())"
            f" WHERE key_id = %s RETURNING {KEY_COLUMNS}",
            (key_id,),
        ).fetchone()
        if row is not None:
            # Delivered when this transaction commits, never before.
            conn.execute("SELECT pg_notify(%s, %s)", (channel, key_id))
    return None if row is None else tuple(row)


def key_secret_row(db: Database, key_id: str) -> tuple[Any, ...] | None:
    """The key's row followed by ``secret_hash, salt, hash_params``; None for an unknown
    id."""
    with db.connection() as conn:
        row = conn.execute(
            f"SELECT {KEY_COLUMNS}, secret_hash, salt, hash_params FROM api_keys"
            " WHERE key_id = %s",
            (key_id,),
        ).fetchone()
    return None if row is None else tuple(row)


def key_revoked(db: Database, key_id: str) -> bool:
    """Whether key ``key_id`` is revoked (or unknown): what a revocation notice is checked
    against, since any role that can connect can send one (``NOTIFY`` has no privilege)."""
    with db.connection() as conn:
        row = conn.execute("SELECT revoked_at IS NOT NULL FROM api_keys WHERE key_id = %s",
                           (key_id,)).fetchone()
    return row is None or bool(row[0])


def end_session(db: Database, token_hash: bytes, *, expires_at: float) -> None:
    """Record a web-page session (by the SHA-256 of its token) as ended until
    ``expires_at`` (epoch seconds, the token's own expiry); drops rows already past their
    expiry. Ending a session twice is harmless."""
    with db.connection() as conn:
        conn.execute("DELETE FROM ended_sessions WHERE expires_at < now()")
        conn.execute(
            "INSERT INTO ended_sessions (token_hash, expires_at)"
            " VALUES (%s, to_timestamp(%s)) ON CONFLICT (token_hash) DO NOTHING",
            (token_hash, expires_at))


def session_ended(db: Database, token_hash: bytes) -> bool:
    """Whether the session whose token hashes to ``token_hash`` was ended (``end_session``)."""
    with db.connection() as conn:
        row = conn.execute("SELECT 1 FROM ended_sessions WHERE token_hash = %s",
                           (token_hash,)).fetchone()
    return row is not None


class RevocationListener:
    """A connection of its own that listens on ``channel``. Raises ``StoreError`` when it
    cannot connect, and ValueError for a channel name that is not a plain identifier."""

    def __init__(self, url: str, channel: str) -> None:
        if not _CHANNEL.match(channel):
            raise ValueError(f"channel must be a lower-case identifier, got {channel!r}")
        self._conn = connect(url, autocommit=True)
        try:
            self._conn.execute(f"LISTEN {channel}")
        except Exception:
            self._conn.close()
            raise

    def payloads(self, *, timeout_s: float) -> Iterator[str]:
        """The payloads of the notifications that arrive within ``timeout_s`` seconds.
        Raises the driver's error when the connection is lost (the caller reconnects)."""
        for note in self._conn.notifies(timeout=timeout_s):
            yield note.payload

    def close(self) -> None:
        """Close the connection (twice is harmless)."""
        try:
            self._conn.close()
        except Exception:  # already broken
            pass
