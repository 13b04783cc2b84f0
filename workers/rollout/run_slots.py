"""A run's bound on remote rollouts in flight, across every rollout worker process.

``RemoteAgentConfig.max_in_flight`` bounds how many of a run's rollouts its RolloutServer
plays at once. A worker process keeps the bound among its own episodes with a semaphore; with
several worker processes (or machines) each would keep it alone, and the server would see
their sum. :func:`run_slot` makes the bound the run's: a slot is a member of a sorted set in
the broker's Redis (``<prefix>remote-in-flight:<run>``), scored with the time it expires.
Taking one is a single Lua script (drop expired members, count, add when below the bound),
so two processes never both take the last slot. A process renews its slots every
``hold_s / 3`` while their rollouts play and removes them when they end; a process that dies
(SIGKILL, its machine gone) stops renewing, and its slots free themselves after ``hold_s``.

A rollout that finds no slot free waits (polling every ``poll_s`` seconds, up to 1 s between
polls) and is not failed: the bound is a pace, not a refusal. Where the broker cannot be
reached, the slot is not taken: the rollout goes on within its process's bound alone, with a
warning in the worker's log (the broker is what queued the task; a broker that fails between
two commands should not end every episode in flight ``error``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from store.arguments import whole_number
from store.settings import Settings

__all__ = ["run_slot", "slots_in_use"]

log = logging.getLogger(__name__)

# KEYS: the run's set. ARGV: now, bound, expiry, member, key lifetime (ms).
_TAKE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return 1
"""

# KEYS: the run's set. ARGV: expiry, member, key lifetime (ms). A slot that expired meanwhile
# (its renewals late by more than hold_s) is not brought back: 0.
_RENEW = """
if not redis.call('ZSCORE', KEYS[1], ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], 'XX', ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""


def _key(settings: Settings, run_id: str) -> str:
    return f"{settings.redis_key_prefix}remote-in-flight:{run_id}"


def _client(settings: Settings) -> Any:
    from workers.broker import redis_client

    return redis_client(settings)


def slots_in_use(settings: Settings, run_id: str) -> int:
    """The run's slots held now (expired ones not counted)."""
    client = _client(settings)
    return int(client.zcount(_key(settings, run_id), f"({time.time()}", "+inf"))


@contextlib.asynccontextmanager
async def run_slot(settings: Settings, run_id: str, limit: int, *, hold_s: float = 30.0,
                   poll_s: float = 0.05) -> AsyncIterator[bool]:
    """Hold one of ``run_id``'s ``limit`` slots for the block (module docstring), waiting for
    one when all are held; yields True, or False when the broker could not be reached and
    the block runs without one. Raises ValueError for ``limit`` < 1 or a ``hold_s`` or
    ``poll_s`` that is not positive."""
    whole_number("limit", limit, minimum=1)
    if not hold_s > 0 or not poll_s > 0:
        raise ValueError(f"hold_s and poll_s must be > 0, got {hold_s!r}, {poll_s!r}")
    import redis

    key = _key(settings, run_id)
    member = uuid.uuid4().hex
    lifetime_ms = str(int(hold_s * 2000))
    try:
        client = _client(settings)
        take = client.register_script(_TAKE)
        wait = poll_s
        while not take(keys=[key], args=[time.time(), limit, time.time() + hold_s, member,
                                         lifetime_ms]):
            await asyncio.sleep(wait)
            wait = min(1.0, wait * 1.5)
    except redis.RedisError as exc:
        log.warning("run %s: the broker could not be reached for a slot of max_in_flight "
                    "(%s); this rollout plays within its process's bound only", run_id, exc)
        yield False
        return

    renew = client.register_script(_RENEW)

    async def keep() -> None:
        while True:
            await asyncio.sleep(hold_s / 3)
            try:
                renew(keys=[key], args=[time.time() + hold_s, member, lifetime_ms])
            except redis.RedisError as exc:
                log.warning("run %s: a slot of max_in_flight could not be renewed (%s)",
                            run_id, exc)

    keeper = asyncio.get_running_loop().create_task(keep())
    try:
        yield True
    finally:
        keeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeper
        try:
            client.zrem(key, member)
        except redis.RedisError as exc:  # it expires after hold_s
            log.warning("run %s: a slot of max_in_flight could not be given back (%s)",
                        run_id, exc)
