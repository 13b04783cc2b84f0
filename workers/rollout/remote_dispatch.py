"""Remote rollouts through the rollout queue: the API sends the request, a rollout worker plays
it (:mod:`workers.rollout.remote`), so no agent loop runs inside a request handler.

- The asynchronous revision (``POST /v1/rollout/init``): :func:`send_remote_rollout` with
  ``answer=False`` queues ``trajstore.remote_rollout_init``; the worker plays the rollout and
  posts the RolloutResponse to the trainer's ``/v1/rollout/completed``.
- The synchronous revision (``POST /rollout``): ``answer=True`` queues
  ``trajstore.remote_rollout``; the worker plays the rollout and pushes a
  :class:`RolloutAnswer` (the HTTP status and body the route answers with) onto the Redis list
  :func:`answer_key` names (:func:`push_answer`, kept :data:`ANSWER_KEEP_S` seconds), and the
  route waits on that list with BLPOP (:func:`await_answer` on the route's event loop, with
  a connection of its own, so a waiting request holds no thread; :func:`wait_answer` for
  callers without a loop). Celery has no result backend here: the list is the one reply
  channel, and it needs no polling.
- :func:`reserve_waiting` counts a project's synchronous rollouts waiting for their answer
  (a Redis counter shared by every API process, kept :data:`WAITING_KEEP_S` seconds after
  its last change) and refuses one over the cap; :func:`release_waiting` gives the place
  back.
- :func:`claim_rollout` marks a rollout id as queued (a Redis key set only if absent, kept
  :data:`CLAIM_S` seconds), so a request repeated before the worker has recorded anything is
  not queued twice; once the episode exists, the store says it was recorded.

The broker and the answer lists are the Redis the settings name (the embedded one when they
name none), under the workers' key prefix. A broker that cannot be reached raises
ConnectionError naming it. Nothing here runs the agent loop: the API imports this module.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from store.settings import Settings
from workers import broker

__all__ = [
    "ANSWER_KEEP_S",
    "CLAIM_S",
    "REMOTE_ROLLOUT_INIT_TASK",
    "REMOTE_ROLLOUT_TASK",
    "RolloutAnswer",
    "answer_key",
    "await_answer",
    "claim_rollout",
    "push_answer",
    "release_rollout",
    "release_waiting",
    "reserve_waiting",
    "send_remote_rollout",
    "send_rollout_task",
    "wait_answer",
    "waiting_key",
]

#: The task that plays a rollout and answers the waiting ``POST /rollout``.
REMOTE_ROLLOUT_TASK = "trajstore.remote_rollout"
#: The task that plays a rollout and reports it to the trainer's ``/v1/rollout/completed``.
REMOTE_ROLLOUT_INIT_TASK = "trajstore.remote_rollout_init"
#: Seconds an answer waits in its list for a route to take it (a route that gave up leaves it).
ANSWER_KEEP_S = 300
#: Seconds a queued rollout id stays claimed (longer than a rollout waits in the queue).
CLAIM_S = 3600
_WAIT_SLICE_S = 2.0
#: Seconds a project's count of waiting rollouts outlives its last change (a process that
#: died while waiting leaves no place taken for longer).
WAITING_KEEP_S = 3600


@dataclass(frozen=True)
class RolloutAnswer:
    """What ``POST /rollout`` answers: ``status`` 200 with the RolloutResponse ``body``, or an
    error ``status`` with its ``code`` and ``message``."""

    status: int
    body: dict[str, Any] | None = None
    code: str | None = None
    message: str | None = None

    def to_json(self) -> str:
        return json.dumps({"status": self.status, "body": self.body, "code": self.code,
                           "message": self.message})

    @classmethod
    def from_json(cls, text: str | bytes) -> RolloutAnswer:
        data = json.loads(text)
        return cls(status=int(data["status"]), body=data.get("body"), code=data.get("code"),
                   message=data.get("message"))


def _redis(settings: Settings) -> Any:
    """A Redis client of the broker (:func:`workers.broker.redis_client`)."""
    return broker.redis_client(settings)


def _unreachable(settings: Settings, exc: BaseException) -> ConnectionError:
    return broker.unreachable(settings, exc)


def answer_key(settings: Settings, rollout_id: str) -> str:
    """The Redis list the answer to rollout ``rollout_id`` is pushed onto."""
    return f"{settings.redis_key_prefix}remote-rollout:{rollout_id}:answer"


def _claim_key(settings: Settings, rollout_id: str) -> str:
    return f"{settings.redis_key_prefix}remote-rollout:{rollout_id}:queued"


def claim_rollout(settings: Settings, rollout_id: str) -> bool:
    """Mark ``rollout_id`` as queued; False when it was marked already (module docstring)."""
    import redis

    try:
        return bool(_redis(settings).set(_claim_key(settings, rollout_id), b"1", nx=True,
                                         ex=CLAIM_S))
    except redis.RedisError as exc:
        raise _unreachable(settings, exc) from None


def release_rollout(settings: Settings, rollout_id: str) -> None:
    """Take the mark of :func:`claim_rollout` off (a send that failed)."""
    import redis

    try:
        _redis(settings).delete(_claim_key(settings, rollout_id))
    except redis.RedisError as exc:
        raise _unreachable(settings, exc) from None


def send_remote_rollout(request: Mapping[str, Any], settings: Settings, *,
                        answer: bool) -> None:
    """Queue the remote rollout ``request`` (a checked RolloutRequest dict) on the rollout
    queue: answered through :func:`push_answer` when ``answer``, else reported to the
    trainer. The request (its ``callback_api_key`` included) travels in the message; task
    events and worker logs show only the rollout id."""
    name = REMOTE_ROLLOUT_TASK if answer else REMOTE_ROLLOUT_INIT_TASK
    send_rollout_task(settings, name, args=[dict(request)],
                      argsrepr=f"(<rollout {request.get('rollout_id')!r}>,)")


def send_rollout_task(settings: Settings, name: str, *, args: list[Any],
                      kwargs: Mapping[str, Any] | None = None,
                      argsrepr: str | None = None) -> None:
    """Queue the task ``name`` on the rollout queue; ConnectionError naming the broker when
    it cannot be reached."""
    broker.send_task(settings, name, queue="rollout", args=args, kwargs=kwargs,
                     argsrepr=argsrepr)


def push_answer(settings: Settings, rollout_id: str, answer: RolloutAnswer) -> None:
    """Push ``answer`` for the route waiting on rollout ``rollout_id``; it is kept
    :data:`ANSWER_KEEP_S` seconds when no route takes it."""
    key = answer_key(settings, rollout_id)
    client = _redis(settings)
    with client.pipeline() as pipe:
        pipe.rpush(key, answer.to_json())
        pipe.expire(key, ANSWER_KEEP_S)
        pipe.execute()


def wait_answer(settings: Settings, rollout_id: str, *, timeout_s: float
                ) -> RolloutAnswer | None:
    """The answer to rollout ``rollout_id``, waiting up to ``timeout_s`` seconds for it (None
    when none came)."""
    import redis

    key = answer_key(settings, rollout_id)
    deadline = time.monotonic() + timeout_s
    # BLPOP in slices shorter than the client's socket timeout (redis-py's default reads time
    # out after 5 s), so a long wait is not mistaken for a dead server.
    while (left := deadline - time.monotonic()) > 0:
        try:
            got = _redis(settings).blpop([key], timeout=min(left, _WAIT_SLICE_S))
        except redis.RedisError as exc:
            raise _unreachable(settings, exc) from None
        if got is not None:
            return RolloutAnswer.from_json(got[1])
    return None


def _async_redis(settings: Settings) -> Any:
    """A new asyncio Redis client of the broker (the caller closes it)."""
    import redis.asyncio

    return redis.asyncio.Redis.from_url(broker.plain_url(settings))


def waiting_key(settings: Settings, project: str) -> str:
    """The Redis counter of project ``project``'s rollouts waiting for their answer."""
    return f"{settings.redis_key_prefix}remote-rollout:waiting:{project}"


async def reserve_waiting(settings: Settings, project: str, *, limit: int) -> int | None:
    """Take one of project ``project``'s ``limit`` places for a waiting rollout; the count
    waiting now, or None (nothing taken) when all are taken. ConnectionError naming the
    broker when it cannot be reached."""
    import redis

    key = waiting_key(settings, project)
    client = _async_redis(settings)
    try:
        async with client.pipeline(transaction=True) as pipe:
            pipe.incr(key)
            pipe.expire(key, WAITING_KEEP_S)
            count = int((await pipe.execute())[0])
        if count > limit:
            await client.decr(key)
            return None
        return count
    except redis.RedisError as exc:
        raise _unreachable(settings, exc) from None
    finally:
        await client.aclose()


async def release_waiting(settings: Settings, project: str) -> None:
    """Give back a place :func:`reserve_waiting` took (never below 0)."""
    import redis

    key = waiting_key(settings, project)
    client = _async_redis(settings)
    try:
        if int(await client.decr(key)) < 0:
            await client.set(key, 0, ex=WAITING_KEEP_S)
    except redis.RedisError as exc:
        raise _unreachable(settings, exc) from None
    finally:
        await client.aclose()


async def await_answer(settings: Settings, rollout_id: str, *, timeout_s: float
                       ) -> RolloutAnswer | None:
    """:func:`wait_answer` on the caller's event loop: BLPOP on a connection of its own,
    holding no thread while it waits."""
    import redis

    key = answer_key(settings, rollout_id)
    deadline = time.monotonic() + timeout_s
    client = _async_redis(settings)
    try:
        while (left := deadline - time.monotonic()) > 0:
            got = await client.blpop([key], timeout=min(left, _WAIT_SLICE_S))
            if got is not None:
                return RolloutAnswer.from_json(got[1])
        return None
    except redis.RedisError as exc:
        raise _unreachable(settings, exc) from None
    finally:
        await client.aclose()
