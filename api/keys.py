"""API keys: created once and shown once, stored as scrypt hashes, revocable.

A key looks like ``tsk_<key_id>_<secret>``: ``key_id`` (16 hex digits) is public and names
the stored row; ``secret`` (43 URL-safe characters, 256 bits) is checked against
``scrypt(secret, salt, n, r, p)``. Every key belongs to one project and has one role:

- ``ingest``: create runs and episodes, append events, use the capture gateway;
- ``read``: query episodes, timelines and samples, export, lease batches;
- ``admin``: everything the other two may do.

Checking scrypt on every request would cost tens of milliseconds, so a key whose secret
passed once is remembered by the SHA-256 of the presented key; the row is still read on
every request, so a revoked key stops working at once.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import re
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass

from store import errors
from store.db import Database
from store.settings import Settings

__all__ = [
    "ROLES",
    "KEY_PREFIX",
    "ApiKey",
    "NewKey",
    "KeyStore",
    "hash_secret",
    "parse_key",
]

ROLES = ("ingest", "read", "admin")
KEY_PREFIX = "tsk_"
_KEY_ID = re.compile(r"^[0-9a-f]{16}$")
_SECRET = re.compile(r"^[A-Za-z0-9_-]{20,200}$")
_PARAMS = re.compile(r"^scrypt\$(\d+)\$(\d+)\$(\d+)$")


@dataclass(frozen=True)
class ApiKey:
    """A stored key (never its secret)."""

    key_id: str
    project: str
    role: str
    name: str | None
    created_at: dt.datetime
    revoked_at: dt.datetime | None = None

    def allows(self, role: str) -> bool:
        """Whether this key may act in ``role`` (``admin`` may act in any)."""
        return self.role == "admin" or self.role == role


@dataclass(frozen=True)
class NewKey:
    """A key just created: ``token`` is the full key, shown this once."""

    key: ApiKey
    token: str


def parse_key(token: str) -> tuple[str, str]:
    """Split ``tsk_<key_id>_<secret>`` into ``(key_id, secret)``. Raises ValueError naming
    what is malformed (without echoing the secret)."""
    if not isinstance(token, str) or not token.startswith(KEY_PREFIX):
        raise ValueError(f"an API key starts with {KEY_PREFIX!r}")
    body = token[len(KEY_PREFIX):]
    key_id, sep, secret = body[:16], body[16:17], body[17:]
    if not _KEY_ID.match(key_id) or sep != "_":
        raise ValueError("an API key is tsk_<16 hex digits>_<secret>")
    if not _SECRET.match(secret):
        raise ValueError("the secret part of the API key is malformed")
    return key_id, secret


def hash_secret(secret: str, *, salt: bytes, n: int, r: int, p: int) -> bytes:
    """scrypt of ``secret`` (32 bytes). Raises ValueError for parameters scrypt refuses
    (``n`` not a power of 2 above 1, memory over 256 MiB)."""
    if n < 2 or n & (n - 1):
        raise ValueError(f"scrypt n must be a power of 2 above 1, got {n}")
    return hashlib.scrypt(secret.encode(), salt=salt, n=n, r=r, p=p, maxmem=256 * 1024 * 1024,
                          dklen=32)


def _check_project(project: object) -> str:
    if not isinstance(project, str) or not project.strip() or len(project) > 200:
        raise ValueError(f"project must be a non-empty string of at most 200 characters, "
                         f"got {project!r}")
    return project


def _check_role(role: object) -> str:
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    return str(role)


_COLUMNS = "key_id, project, role, name, created_at, revoked_at"


def _key(row: tuple[object, ...]) -> ApiKey:
    return ApiKey(*row)  # type: ignore[arg-type]


class KeyStore:
    """The ``api_keys`` table of one database."""

    def __init__(self, db: Database, settings: Settings) -> None:
        self.db = db
        self.settings = settings
        self._verified: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def create(self, *, project: str, role: str, name: str | None = None) -> NewKey:
        """Create a key of ``project`` with ``role``; returns it with its token (shown once).
        Raises ValueError for an empty project or an unknown role."""
        project, role = _check_project(project), _check_role(role)
        if name is not None and (not isinstance(name, str) or len(name) > 200):
            raise ValueError(f"name must be a string of at most 200 characters, got {name!r}")
        s = self.settings
        key_id = secrets.token_hex(8)
        secret = secrets.token_urlsafe(32)
        salt = secrets.token_bytes(16)
        digest = hash_secret(secret, salt=salt, n=s.api_key_scrypt_n, r=s.api_key_scrypt_r,
                             p=s.api_key_scrypt_p)
        params = f"scrypt${s.api_key_scrypt_n}${s.api_key_scrypt_r}${s.api_key_scrypt_p}"
        with self.db.transaction() as conn:
            row = conn.execute(
                f"INSERT INTO api_keys (key_id, project, role, name, secret_hash, salt,"
                f" hash_params) VALUES (%s, %s, %s, %s, %s, %s, %s) RETURNING {_COLUMNS}",
                (key_id, project, role, name, digest, salt, params),
            ).fetchone()
        return NewKey(_key(row), f"{KEY_PREFIX}{key_id}_{secret}")

    def list(self, *, project: str | None = None, include_revoked: bool = False
             ) -> list[ApiKey]:
        """Keys, oldest first, of one project or all; revoked ones only when asked."""
        with self.db.connection() as conn:
            rows = conn.execute(
                f"SELECT {_COLUMNS} FROM api_keys"
                " WHERE (%s::text IS NULL OR project = %s) AND (%s OR revoked_at IS NULL)"
                " ORDER BY created_at, key_id",
                (project, project, include_revoked),
            ).fetchall()
        return [_key(r) for r in rows]

    def revoke(self, key_id: str) -> ApiKey:
        """Revoke a key (revoking twice keeps the first time). Raises ``NotFoundError`` for
        an unknown key id."""
        with self.db.transaction() as conn:
            row = conn.execute(
                f"UPDATE api_keys SET revoked_at = coalesce(revoked_at, now())"
                f" WHERE key_id = %s RETURNING {_COLUMNS}",
                (key_id,),
            ).fetchone()
        if row is None:
            raise errors.NotFoundError(f"no API key {key_id!r}")
        with self._lock:
            self._verified.pop(key_id, None)
        return _key(row)

    def verify(self, token: str) -> ApiKey | None:
        """The live key ``token`` is, or None when it is malformed, unknown, revoked or its
        secret is wrong."""
        try:
            key_id, secret = parse_key(token)
        except ValueError:
            return None
        with self.db.connection() as conn:
            row = conn.execute(
                f"SELECT {_COLUMNS}, secret_hash, salt, hash_params FROM api_keys"
                " WHERE key_id = %s",
                (key_id,),
            ).fetchone()
        if row is None or row[5] is not None:
            return None
        fingerprint = hashlib.sha256(token.encode()).digest()
        with self._lock:
            known = self._verified.get(key_id)
        if known is not None:
            return _key(row[:6]) if hmac.compare_digest(known, fingerprint) else None
        match = _PARAMS.match(row[8])
        if match is None:
            return None
        n, r, p = (int(g) for g in match.groups())
        if not hmac.compare_digest(hash_secret(secret, salt=bytes(row[7]), n=n, r=r, p=p),
                                   bytes(row[6])):
            return None
        with self._lock:
            self._verified[key_id] = fingerprint
            while len(self._verified) > 10_000:
                self._verified.popitem(last=False)
        return _key(row[:6])
