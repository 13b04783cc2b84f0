"""The ``api_keys`` table: the SQL behind ``api.keys.KeyStore``.

Rows are plain tuples in the order of :data:`KEY_COLUMNS` (``key_id, project, role, name,
created_at, revoked_at, run_id, episode_id``); :func:`key_secret_row` gives the first six,
then ``secret_hash, salt, hash_params``, then ``run_id, episode_id``. A key past its
``expires_at`` reads as revoked at that time. :func:`mint_episode_key` makes the short-lived
credential of one episode (a rollout worker gives it to a user's RolloutServer).
Hashing, parsing and caching keys are the API's business; storing them is this module's.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re
import secrets
from collections.abc import Iterator
from typing import Any

from store.db import Database, connect

__all__ = [
    "KEY_COLUMNS",
    "KEY_PREFIX",
    "MAX_EPISODE_KEY_TTL_S",
    "REVOKED_CHANNEL",
    "RevocationListener",
    "end_session",
    "hash_secret",
    "insert_key",
    "key_revoked",
    "key_secret_row",
    "list_keys",
    "mint_episode_key",
    "revoke_key",
    "session_ended",
]

_REVOKED = "coalesce(revoked_at, CASE WHEN expires_at <= now() THEN expires_at END)"
_FIRST = f"key_id, project, role, name, created_at, {_REVOKED} AS revoked_at"
KEY_COLUMNS = f"{_FIRST}, run_id, episode_id"
#: The channel a revocation is announced on (every API process listens to it).
REVOKED_CHANNEL = "trajstore_api_keys_revoked"
#: The prefix of every key's token: ``tsk_<16 hex digits>_<secret>``.
KEY_PREFIX = "tsk_"
_CHANNEL = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
#: The longest life of an episode's credential, in seconds: the longest rollout
#: (``RemoteAgentConfig.timeout_s``, one day) and the minute a rollout worker adds to it.
MAX_EPISODE_KEY_TTL_S = 86_400 + 60


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


def hash_secret(secret: str, *, salt: bytes, n: int, r: int, p: int) -> bytes:
    """scrypt of ``secret`` (32 bytes). Raises ValueError for parameters scrypt refuses
    (``n`` not a power of 2 above 1, memory over 256 MiB)."""
    if n < 2 or n & (n - 1):
        raise ValueError(f"scrypt n must be a power of 2 above 1, got {n}")
    return hashlib.scrypt(secret.encode(), salt=salt, n=n, r=r, p=p, maxmem=256 * 1024 * 1024,
                          dklen=32)


def mint_episode_key(db: Database, *, project: str, run_id: str, episode_id: str,
                     ttl_s: float, scrypt: tuple[int, int, int],
                     now: dt.datetime | None = None) -> tuple[str, str]:
    """Store a new ``ingest`` key of ``project`` that may record only episode
    ``episode_id`` of run ``run_id`` and expires ``ttl_s`` seconds after ``now`` (default:
    the current time; a caller that reports the expiry passes the ``now`` it adds to);
    returns ``(key_id, token)`` (the token is shown this once). ``scrypt`` is ``(n, r, p)``.
    The ttl is not checked here (a negative one makes a key that is expired already); the
    API's route bounds it by :data:`MAX_EPISODE_KEY_TTL_S`. Raises ValueError for scrypt
    parameters :func:`hash_secret` refuses."""
    n, r, p = scrypt
    key_id = secrets.token_hex(8)
    secret = secrets.token_urlsafe(32)
    salt = secrets.token_bytes(16)
    digest = hash_secret(secret, salt=salt, n=n, r=r, p=p)
    expires = (now or dt.datetime.now(dt.UTC)) + dt.timedelta(seconds=ttl_s)
    with db.transaction() as conn:
        conn.execute(
            "INSERT INTO api_keys (key_id, project, role, name, secret_hash, salt, hash_params,"
            " run_id, episode_id, expires_at) VALUES (%s, %s, 'ingest', %s, %s, %s, %s, %s,"
            " %s, %s)",
            (key_id, project, f"episode {episode_id[:180]}", digest, salt,
             f"scrypt${n}${r}${p}", run_id, episode_id, expires))
    return key_id, f"{KEY_PREFIX}{key_id}_{secret}"


def list_keys(db: Database, *, project: str | None, include_revoked: bool
              ) -> list[tuple[Any, ...]]:
    """Key rows, oldest first, of one project (all when None); revoked ones only when
    ``include_revoked``."""
    with db.connection() as conn:
        rows = conn.execute(
            f"SELECT {KEY_COLUMNS} FROM api_keys"
            " WHERE (%s::text IS NULL OR project = %s) AND (%s OR (revoked_at IS NULL"
            " AND (expires_at IS NULL OR expires_at > now())))"
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
            f"SELECT {_FIRST}, secret_hash, salt, hash_params, run_id, episode_id FROM api_keys"
            " WHERE key_id = %s",
            (key_id,),
        ).fetchone()
    return None if row is None else tuple(row)


def key_revoked(db: Database, key_id: str) -> bool:
    """Whether key ``key_id`` is revoked (or unknown): what a revocation notice is checked
    against, since any role that can connect can send one (``NOTIFY`` has no privilege)."""
    with db.connection() as conn:
        row = conn.execute(f"SELECT {_REVOKED} IS NOT NULL FROM api_keys WHERE key_id = %s",
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
