"""API keys: created once and shown once, stored as scrypt hashes, revocable.

A key looks like ``tsk_<key_id>_<secret>``: ``key_id`` (16 hex digits) is public and names
the stored row; ``secret`` (43 URL-safe characters, 256 bits) is checked against
``scrypt(secret, salt, n, r, p)``. Every key belongs to one project and has one role:

- ``ingest``: create runs and episodes, append their events, use the capture gateway;
- ``read``: query runs, episodes, timelines and samples, export (nothing that changes state);
- ``train``: what ``read`` may, and what a trainer changes: lease batches and acknowledge,
  release or renew leases, append ``policy_updated``, report ``policy_served``;
- ``admin``: everything the others may do.

Checking scrypt on every request would cost tens of milliseconds, so a key whose secret
passed once is remembered by the SHA-256 of the presented key. For ``api_key_cache_s``
seconds an API process then trusts it without reading its row, but only while it listens
for revocations: ``revoke`` sends a PostgreSQL notification with the key id when it
commits, and every process listening drops the key at once (after reading the row: a
notice for a key that is not revoked, which any database role can send, is ignored). A
process that cannot listen (the connection dropped) reads the row on every request until it
listens again, so a revoked key never keeps working.

Wrong secrets cost a full scrypt each, so a flood of them would starve every other request.
Two guards keep that cost bounded, per API process:

- a failure cache: a key refused once (unknown, revoked or wrong secret) is remembered by the
  SHA-256 of the whole presented key for ``api_key_failure_cache_s`` seconds and refused
  again (401) without reading its row or hashing;
- a failure budget per key id and source address: at most ``api_key_failure_budget`` wrong
  secrets of one key id from one source (the client's address) are hashed within
  ``api_key_failure_cache_s`` seconds; further secrets of that key id from that source which
  this process has not seen right are answered 429 with ``Retry-After``
  (``KeyFailureBudgetExceeded``), unhashed. A flood from one source therefore never throttles
  the same key id from another source: its right secret is checked at once. The right secret
  is never refused by the budget once this process has checked it (from any source): its
  fingerprint is remembered (until the key is revoked) and skips the hash; and even while a
  source is over budget for a key id, one unknown secret per second from it is still
  checked, so a right secret this process has not seen before gets in on a retry there too.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import logging
import math
import re
import secrets
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

from store import api_keys as table
from store import errors
from store.db import Database
from store.settings import Settings

__all__ = [
    "ROLES",
    "KEY_PREFIX",
    "ApiKey",
    "EpisodeCredential",
    "NewKey",
    "KeyStore",
    "KeyFailureBudgetExceeded",
    "hash_secret",
    "parse_key",
]

log = logging.getLogger(__name__)

ROLES = ("ingest", "read", "train", "admin")
#: Roles that hold another role's rights besides their own (``admin`` holds every role).
IMPLIED = {"train": frozenset({"read"})}
#: The notification channel revocations are announced on.
REVOKED_CHANNEL = table.REVOKED_CHANNEL
KEY_PREFIX = table.KEY_PREFIX
hash_secret = table.hash_secret
SESSION_PREFIX = "tss1."
_KEY_ID = re.compile(r"^[0-9a-f]{16}$")
#: A session's expiry (epoch seconds) and nonce: ``<digits>-<16 hex digits>``.
_STAMP = re.compile(r"^[0-9]{1,12}-[0-9a-f]{16}$")
_SECRET = re.compile(r"^[A-Za-z0-9_-]{20,200}$")
_PARAMS = re.compile(r"^scrypt\$(\d+)\$(\d+)\$(\d+)$")


#: Entries each in-memory table of a key store keeps at most (oldest dropped first).
_MAX_ENTRIES = 10_000
#: While a key id is over its failure budget, one unknown secret per this many seconds is
#: still checked, so that a right secret never seen by this process gets in on a retry.
_OVER_BUDGET_CHECK_S = 1.0


class KeyFailureBudgetExceeded(Exception):
    """Too many wrong secrets for one key id lately: this one was not checked. Retry after
    ``retry_after_s`` seconds."""

    def __init__(self, key_id: str, retry_after_s: int) -> None:
        super().__init__(f"too many wrong secrets for API key {key_id} lately; retry after "
                         f"{retry_after_s} s")
        self.key_id = key_id
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class ApiKey:
    """A stored key (never its secret). ``run_id``: the one run a credential is scoped to
    (a remote-rollout call's unseen rollout id is created there when the request names no
    run, and a request naming another run is refused); None for a key of the whole
    project."""

    key_id: str
    project: str
    role: str
    name: str | None
    created_at: dt.datetime
    revoked_at: dt.datetime | None = None
    run_id: str | None = None
    #: The one episode a credential may record into (a rollout worker's key for a user's
    #: RolloutServer, ``store.api_keys.mint_episode_key``); None for any.
    episode_id: str | None = None

    def allows(self, role: str) -> bool:
        """Whether this key may act in ``role`` (``admin`` may act in any, ``train`` also
        as ``read``)."""
        return self.role in ("admin", role) or role in IMPLIED.get(self.role, ())


@dataclass(frozen=True)
class NewKey:
    """A key just created: ``token`` is the full key, shown this once."""

    key: ApiKey
    token: str


@dataclass(frozen=True)
class EpisodeCredential:
    """The credential of one episode, just minted (``KeyStore.mint_episode``): ``token`` is
    shown this once; the key reads as revoked from ``expires_at`` on."""

    key_id: str
    token: str
    expires_at: dt.datetime


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


def _check_project(project: object) -> str:
    if not isinstance(project, str) or not project.strip() or len(project) > 200:
        raise ValueError(f"project must be a non-empty string of at most 200 characters, "
                         f"got {project!r}")
    return project


def _check_role(role: object) -> str:
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    return str(role)


def _key(row: tuple[object, ...]) -> ApiKey:
    return ApiKey(*row)  # type: ignore[arg-type]


class KeyStore:
    """The ``api_keys`` table of one database."""

    def __init__(self, db: Database, settings: Settings) -> None:
        self.db = db
        self.settings = settings
        # key_id -> (fingerprint of the presented key, the key, when its row was read)
        self._verified: OrderedDict[str, tuple[bytes, ApiKey, float]] = OrderedDict()
        # key_id -> fingerprint of the key whose secret scrypt accepted (skips the hash; the
        # row, and so revocation, is still read); dropped when the key is revoked
        self._right: OrderedDict[str, bytes] = OrderedDict()
        # fingerprint of a refused key -> when it was refused
        self._refused: OrderedDict[bytes, float] = OrderedDict()
        # (key_id, source address) -> times of its recent wrong secrets (at most the
        # budget), and when an unknown secret was last checked while over budget
        self._wrong: OrderedDict[tuple[str, str], deque[float]] = OrderedDict()
        self._over_budget_checked: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()
        self._generation = 0  # bumped by every revocation heard
        self._listening = False
        self._listener: threading.Thread | None = None
        self._stop = threading.Event()

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
        row = table.insert_key(self.db, key_id=key_id, project=project, role=role, name=name,
                               secret_hash=digest, salt=salt, hash_params=params)
        return NewKey(_key(row), f"{KEY_PREFIX}{key_id}_{secret}")

    def list(self, *, project: str | None = None, include_revoked: bool = False
             ) -> list[ApiKey]:
        """Keys, oldest first, of one project or all; revoked ones only when asked."""
        rows = table.list_keys(self.db, project=project, include_revoked=include_revoked)
        return [_key(r) for r in rows]

    def revoke(self, key_id: str) -> ApiKey:
        """Revoke a key (revoking twice keeps the first time) and tell every listening API
        process. Raises ``NotFoundError`` for an unknown key id."""
        row = table.revoke_key(self.db, key_id, channel=REVOKED_CHANNEL)
        if row is None:
            raise errors.NotFoundError(f"no API key {key_id!r}")
        self._forget(key_id)
        return _key(row)

    def mint_episode(self, *, project: str, run_id: str, episode_id: str, ttl_s: float
                     ) -> EpisodeCredential:
        """A new credential of ``project`` that may record only episode ``episode_id`` of run
        ``run_id`` (``store.api_keys.mint_episode_key``), hashed at this store's scrypt cost,
        expiring ``ttl_s`` seconds from now. The caller checks that the episode exists and
        bounds ``ttl_s`` (a negative one makes a key that is expired already)."""
        s = self.settings
        now = dt.datetime.now(dt.UTC)
        key_id, token = table.mint_episode_key(
            self.db, project=project, run_id=run_id, episode_id=episode_id, ttl_s=ttl_s,
            scrypt=(s.api_key_scrypt_n, s.api_key_scrypt_r, s.api_key_scrypt_p), now=now)
        return EpisodeCredential(key_id, token, now + dt.timedelta(seconds=ttl_s))

    def revoke_episode(self, episode_id: str, key_id: str) -> ApiKey:
        """Revoke ``key_id``, a credential of episode ``episode_id`` (``revoke``: twice keeps
        the first time). Raises ``NotFoundError`` naming both when there is no such key or it
        is not that episode's credential (a key of the whole project is never revoked
        here)."""
        row = table.key_secret_row(self.db, key_id)
        # The row: the key's columns, then secret_hash, salt, hash_params, run_id, episode_id.
        if row is None or row[10] != episode_id:
            raise errors.NotFoundError(f"no credential {key_id[:40]!r} of episode "
                                       f"{episode_id!r}")
        return self.revoke(key_id)

    def trusted(self, token: str) -> ApiKey | None:
        """The key ``token`` is when this process trusts it without reading its row (module
        docstring), else None (then ``verify`` decides). Does no I/O."""
        ttl = self.settings.api_key_cache_s
        if ttl <= 0 or not token.startswith(KEY_PREFIX):
            return None
        self._ensure_listener()
        with self._lock:
            cached = self._verified.get(token[len(KEY_PREFIX):len(KEY_PREFIX) + 16]) \
                if self._listening else None
        if cached is None or time.monotonic() - cached[2] >= ttl:
            return None
        fingerprint = hashlib.sha256(token.encode()).digest()
        return cached[1] if hmac.compare_digest(cached[0], fingerprint) else None

    def verify(self, token: str, source: str = "") -> ApiKey | None:
        """The live key ``token`` is, or None when it is malformed, unknown, revoked or its
        secret is wrong. Raises ``KeyFailureBudgetExceeded`` (nothing checked) when its key id
        had too many wrong secrets lately from ``source`` (the client's address) and this
        secret is not one this process checked right before (module docstring)."""
        key = self.trusted(token)
        if key is not None:
            return key
        try:
            key_id, secret = parse_key(token)
        except ValueError:
            return None
        fingerprint = hashlib.sha256(token.encode()).digest()
        now = time.monotonic()
        with self._lock:
            if self._refused_lately(fingerprint, now):
                return None
            generation = self._generation
            known = self._right.get(key_id)
        right_before = known is not None and hmac.compare_digest(known, fingerprint)
        if not right_before:
            self._spend_budget((key_id, source), now)
        row = table.key_secret_row(self.db, key_id)
        if row is None or row[5] is not None:
            self._forget(key_id)
            self._remember_refusal(fingerprint, now)
            return None
        key = _key((*row[:6], *row[9:11]))
        if not right_before:
            match = _PARAMS.match(row[8])
            if match is None:
                return None
            n, r, p = (int(g) for g in match.groups())
            if not hmac.compare_digest(hash_secret(secret, salt=bytes(row[7]), n=n, r=r, p=p),
                                       bytes(row[6])):
                self._remember_refusal(fingerprint, time.monotonic(),
                                       budget=(key_id, source))
                return None
        with self._lock:
            # A revocation heard while the row was being read may be about this key: do
            # not trust the row then (it is read again next time).
            if self._generation == generation:
                self._verified[key_id] = (fingerprint, key, time.monotonic())
                self._verified.move_to_end(key_id)
                while len(self._verified) > _MAX_ENTRIES:
                    self._verified.popitem(last=False)
            # That the secret is right holds whatever was heard meanwhile (only the hash is
            # skipped next time; the row, and so revocation, is still read).
            self._right[key_id] = fingerprint
            self._right.move_to_end(key_id)
            while len(self._right) > _MAX_ENTRIES:
                self._right.popitem(last=False)
        return key

    # --- wrong secrets -----------------------------------------------------------------------

    def _refused_lately(self, fingerprint: bytes, now: float) -> bool:
        """Whether this very key was refused within the failure cache time (lock held)."""
        ttl = self.settings.api_key_failure_cache_s
        when = self._refused.get(fingerprint)
        if when is None:
            return False
        if ttl <= 0 or now - when >= ttl:
            del self._refused[fingerprint]
            return False
        return True

    def _remember_refusal(self, fingerprint: bytes, now: float, *,
                          budget: tuple[str, str] | None = None) -> None:
        """Remember a refused key; a wrong secret of an existing key id also counts against
        the budget of that key id from its source (``budget``)."""
        s = self.settings
        with self._lock:
            if s.api_key_failure_cache_s > 0:
                self._refused[fingerprint] = now
                self._refused.move_to_end(fingerprint)
                while len(self._refused) > _MAX_ENTRIES:
                    self._refused.popitem(last=False)
            if budget is not None and s.api_key_failure_budget > 0:
                times = self._wrong.get(budget)
                if times is None:
                    times = self._wrong[budget] = deque(maxlen=s.api_key_failure_budget)
                times.append(now)
                self._wrong.move_to_end(budget)
                while len(self._wrong) > _MAX_ENTRIES:
                    self._wrong.popitem(last=False)

    def _over_budget(self, budget: tuple[str, str], now: float) -> int | None:
        """Seconds until a key id from a source (``budget``) is back within its budget of
        wrong secrets, or None when it is within it (lock held)."""
        s = self.settings
        which, limit, window = budget, s.api_key_failure_budget, s.api_key_failure_cache_s
        if limit <= 0 or window <= 0:
            return None
        times = self._wrong.get(which)
        if times is None or len(times) < limit or now - times[0] >= window:
            return None
        return max(1, math.ceil(window - (now - times[0])))

    def _spend_budget(self, budget: tuple[str, str], now: float) -> None:
        """Raise ``KeyFailureBudgetExceeded`` when the key id is over its budget of wrong
        secrets from this source (``budget``) and an over-budget check was made less than a
        second ago; otherwise take that check (when over budget) and return."""
        with self._lock:
            wait = self._over_budget(budget, now)
            if wait is None:
                return
            if now - self._over_budget_checked.get(budget, -math.inf) >= _OVER_BUDGET_CHECK_S:
                self._over_budget_checked[budget] = now
                if len(self._over_budget_checked) > _MAX_ENTRIES:
                    self._over_budget_checked.clear()
                return
        raise KeyFailureBudgetExceeded(budget[0], wait)

    def refused(self, token: str, source: str = "") -> bool:
        """Whether ``token`` is refused from memory: True when this very key was refused
        within ``api_key_failure_cache_s``. Raises ``KeyFailureBudgetExceeded`` when its key
        id is over its budget from ``source``, the secret is not one this process checked
        right, and no check is due. Does no I/O and no hashing (the API calls it on its
        event loop); False leaves the decision to ``verify``."""
        if not token.startswith(KEY_PREFIX):
            return False
        key_id = token[len(KEY_PREFIX):len(KEY_PREFIX) + 16]
        fingerprint = hashlib.sha256(token.encode()).digest()
        now = time.monotonic()
        with self._lock:
            if self._refused_lately(fingerprint, now):
                return True
            known = self._right.get(key_id)
            if known is not None and hmac.compare_digest(known, fingerprint):
                return False
            budget = (key_id, source)
            wait = self._over_budget(budget, now)
            due = now - self._over_budget_checked.get(budget, -math.inf) >= _OVER_BUDGET_CHECK_S
        if wait is not None and not due:
            raise KeyFailureBudgetExceeded(key_id, wait)
        return False

    def session(self, key: ApiKey, *, ttl_s: float) -> str:
        """A session token for the web page's cookie: ``tss1.<key id>.<expiry>-<nonce>.<mac>``,
        the MAC keyed by the key's stored secret hash (which never leaves the database), so the
        cookie does not hold the key, any API process can check it, and it dies with the key
        (revocation) or at its expiry. Raises NotFoundError for an unknown key."""
        row = table.key_secret_row(self.db, key.key_id)
        if row is None:
            raise errors.NotFoundError(f"no API key {key.key_id!r}")
        # A nonce of its own: two sign-ins in the same second are two sessions, so signing
        # out of one (``end_session``) leaves the other.
        payload = f"{key.key_id}.{int(time.time() + ttl_s)}-{secrets.token_hex(8)}"
        mac = hmac.new(bytes(row[6]), payload.encode(), hashlib.sha256).hexdigest()
        return f"{SESSION_PREFIX}{payload}.{mac}"

    def verify_session(self, token: str) -> ApiKey | None:
        """The live key of a ``session`` token, or None when it is malformed (a key id that
        is not 16 hex digits included: nothing malformed reaches the database), expired, its
        MAC is wrong, its key is unknown or revoked, or it was ended (``end_session``)."""
        if not token.startswith(SESSION_PREFIX):
            return None
        parts = token[len(SESSION_PREFIX):].split(".")
        if (len(parts) != 3 or not _KEY_ID.match(parts[0]) or not _STAMP.match(parts[1])
                or int(parts[1].split("-")[0]) < time.time()):
            return None
        key_id, expiry, mac = parts
        row = table.key_secret_row(self.db, key_id)
        if row is None or row[5] is not None:
            return None
        expected = hmac.new(bytes(row[6]), f"{key_id}.{expiry}".encode(),
                            hashlib.sha256).hexdigest()
        if not hmac.compare_digest(expected, mac):
            return None
        if table.session_ended(self.db, hashlib.sha256(token.encode()).digest()):
            return None
        return _key((*row[:6], *row[9:11]))

    def end_session(self, token: str) -> bool:
        """End the session of ``token`` on the server (signing out): from now on
        ``verify_session`` refuses it in every API process, though the cookie may still be
        sent. True when it was a live session; a malformed, expired or unknown token ends
        nothing (False)."""
        if self.verify_session(token) is None:
            return False
        expiry = int(token[len(SESSION_PREFIX):].split(".")[1].split("-")[0])
        table.end_session(self.db, hashlib.sha256(token.encode()).digest(), expires_at=expiry)
        return True

    def _forget(self, key_id: str) -> None:
        with self._lock:
            self._verified.pop(key_id, None)
            self._right.pop(key_id, None)
            self._generation += 1

    # --- hearing revocations ---------------------------------------------------------------

    def _ensure_listener(self) -> None:
        if self._listener is not None and self._listener.is_alive():
            return
        with self._lock:
            if self._listener is not None and self._listener.is_alive():
                return
            self._stop.clear()
            self._listener = threading.Thread(target=self._listen, name="api-key-revocations",
                                              daemon=True)
            self._listener.start()

    def _listen(self) -> None:
        """Drop revoked keys as their notifications arrive; while not listening, trust
        nothing cached (``verify`` reads the row every time)."""
        while not self._stop.is_set():
            listener: table.RevocationListener | None = None
            try:
                listener = table.RevocationListener(self.db.url, REVOKED_CHANNEL)
                with self._lock:
                    # Anything revoked while nobody listened is unknown: start afresh.
                    self._verified.clear()
                    self._generation += 1
                    self._listening = True
                while not self._stop.is_set():
                    for key_id in listener.payloads(timeout_s=1.0):
                        # Any role that can connect can NOTIFY (PostgreSQL has no privilege
                        # for it, the analyst role included): a notice is believed only when
                        # the key's row says revoked, so a forged one drops nothing.
                        if _KEY_ID.match(key_id) and table.key_revoked(self.db, key_id):
                            self._forget(key_id)
            except Exception as exc:  # connection lost: fall back to reading rows
                log.warning("not hearing API key revocations (%s); checking every request",
                            exc)
            finally:
                with self._lock:
                    self._listening = False
                    self._verified.clear()
                if listener is not None:
                    listener.close()
            self._stop.wait(1.0)

    def close(self) -> None:
        """Stop listening for revocations."""
        self._stop.set()
        if self._listener is not None:
            self._listener.join(timeout=5)
