"""Who mints and revokes the credential of one episode that a user's RolloutServer records
with (:mod:`workers.rollout.remote_agent`): the worker's database, or the trajstore API the
worker writes through.

An :class:`EpisodeCredentials` mints a key that may record only one episode of one run and
expires ``ttl_s`` seconds from now, and revokes it. Two implementations, as the rollout
worker's :class:`~workers.rollout.group_log.GroupLog`:

- :class:`StoreCredentials` in the database (``store.api_keys.mint_episode_key`` and
  ``revoke_key``: the key is the run's project's, hashed at the worker's scrypt cost);
- :class:`ApiCredentials` through the API (``POST /v1/episodes/{id}/credentials`` and
  ``DELETE /v1/episodes/{id}/credentials/{key_id}``, with the worker's ``admin`` key: the
  API makes the key in the episode's project at its own scrypt cost).

Both raise the store's errors: ``TransientError`` when the database or the API cannot be
reached (a Celery delivery retries the group), ``NotFoundError`` for an unknown episode or
credential, ``StoreError`` for any other refusal (a worker key that is not ``admin`` is
403, a finished episode 409).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from store import api_keys
from store.db import Database
from workers.rollout.group_log import ApiGroupLog

__all__ = ["ApiCredentials", "EpisodeCredentials", "StoreCredentials"]


@runtime_checkable
class EpisodeCredentials(Protocol):
    """Mints and revokes the credential of one episode (module docstring)."""

    def mint(self, *, run_id: str, episode_id: str, ttl_s: float) -> tuple[str, str]:
        """A new key that may record only ``episode_id`` of ``run_id`` and expires ``ttl_s``
        seconds from now: ``(key_id, token)``, the token shown this once."""
        ...

    def revoke(self, *, episode_id: str, key_id: str) -> None:
        """Revoke credential ``key_id`` of ``episode_id`` at once (twice is harmless)."""
        ...


class StoreCredentials:
    """:class:`EpisodeCredentials` in the database ``db``: keys of ``project`` hashed with
    ``scrypt`` = ``(n, r, p)``. Raises TypeError for a ``db`` that is not a Database."""

    def __init__(self, db: Database, *, project: str, scrypt: tuple[int, int, int]) -> None:
        if not isinstance(db, Database):
            raise TypeError(f"db must be a Database, got {type(db).__name__}")
        self.db = db
        self.project = project
        self.scrypt = scrypt

    def mint(self, *, run_id: str, episode_id: str, ttl_s: float) -> tuple[str, str]:
        return api_keys.mint_episode_key(self.db, project=self.project, run_id=run_id,
                                         episode_id=episode_id, ttl_s=ttl_s,
                                         scrypt=self.scrypt)

    def revoke(self, *, episode_id: str, key_id: str) -> None:
        api_keys.revoke_key(self.db, key_id, channel=api_keys.REVOKED_CHANNEL)


class ApiCredentials:
    """:class:`EpisodeCredentials` through the trajstore API that ``log`` writes to (its
    connection and key, which must be ``admin``; the API's answers become the store's
    errors as ``log``'s do). Raises TypeError for a ``log`` that is not an ApiGroupLog."""

    def __init__(self, log: ApiGroupLog) -> None:
        if not isinstance(log, ApiGroupLog):
            raise TypeError(f"log must be an ApiGroupLog, got {type(log).__name__}")
        self.log = log

    def mint(self, *, run_id: str, episode_id: str, ttl_s: float) -> tuple[str, str]:
        # The API scopes the key to the episode's run as it stored it; run_id names the
        # same run (the worker started the episode in it).
        body = self.log.request("POST", f"/v1/episodes/{episode_id}/credentials",
                                json={"ttl_s": ttl_s}, stream_id=episode_id)
        return str(body["key_id"]), str(body["token"])

    def revoke(self, *, episode_id: str, key_id: str) -> None:
        self.log.request("DELETE", f"/v1/episodes/{episode_id}/credentials/{key_id}",
                         stream_id=episode_id)
