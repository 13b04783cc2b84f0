"""Per-project budgets on the shared rollout queue, kept in Redis (the broker).

Every rollout task a project sends (a remote rollout of ``POST /rollout`` or ``POST
/v1/rollout/init``, a branch, a group) carries a *budget*: its project and a ticket.

- **Admission** (:func:`send_budgeted`, at the sender): a project holds at most
  ``rollout_project_queued`` tasks queued or running at once (a sorted set of tickets per
  project, each expiring after :func:`_ticket_s` so a task lost with its worker frees its
  place). One more is refused with :class:`RolloutBudgetExceeded` naming the setting; the API
  answers it 429.
- **Running** (:func:`start`, in the worker): at most ``rollout_project_running`` of one
  project's tasks run at once. A task that finds its project at the cap does not hold the
  worker slot: it is *parked* (its message kept on the project's Redis list) and the slot goes
  to the next message of the queue, which is another project's as soon as the flooding
  project's messages are parked. When one of the project's tasks ends (:func:`finish`), the
  oldest parked task is queued again, at the queue's tail. So a project with many slow
  rollouts has ``rollout_project_running`` worker slots, and every other project finds the
  others free.

Taking a place, parking and handing a freed place on are single Lua scripts, so a task is
never parked while its project has a free place (no task waits for a release that will not
come). A task's redelivery (its worker died; groups and branches acknowledge late) finds its
ticket running and runs. Tasks without a budget (sent by an older producer) run unbudgeted.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from store.settings import Settings

__all__ = ["RolloutBudgetExceeded", "finish", "in_use", "parked_count", "send_budgeted",
           "send_remote_budgeted",
           "start"]

_ADMIT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[4])
return 1
"""

# KEYS: running, parked. ARGV: now, cap, expiry, ticket, message.
_START = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZSCORE', KEYS[1], ARGV[4]) then return 1 end
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[2]) then
  redis.call('ZADD', KEYS[1], ARGV[3], ARGV[4])
  return 1
end
redis.call('RPUSH', KEYS[2], ARGV[5])
return 0
"""

# KEYS: running, admitted, parked. ARGV: now, cap, ticket. Returns the parked messages to
# queue again (as many as the project has free places).
_FINISH = """
redis.call('ZREM', KEYS[1], ARGV[3])
redis.call('ZREM', KEYS[2], ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local free = tonumber(ARGV[2]) - redis.call('ZCARD', KEYS[1])
local out = {}
while free > 0 do
  local m = redis.call('LPOP', KEYS[3])
  if not m then break end
  table.insert(out, m)
  free = free - 1
end
return out
"""


class RolloutBudgetExceeded(Exception):
    """A project has ``limit`` rollout tasks queued or running already; the message names the
    setting."""

    def __init__(self, project: str, limit: int) -> None:
        super().__init__(
            f"project {project!r} has {limit} rollout(s) queued or running already, the limit "
            "(setting TRAJSTORE_ROLLOUT_PROJECT_QUEUED); retry when some have finished")
        self.project = project
        self.limit = limit


@dataclass(frozen=True)
class _Keys:
    admitted: str
    running: str
    parked: str


def _keys(settings: Settings, project: str) -> _Keys:
    base = f"{settings.redis_key_prefix}rollout-budget:{project}:"
    return _Keys(base + "admitted", base + "running", base + "parked")


def _ticket_s(settings: Settings) -> float:
    """How long a ticket holds its place when its task never ends (its worker died): twice
    the broker's visibility timeout, after which a lost task is redelivered."""
    return 2.0 * settings.visibility_timeout_s


def _client(settings: Settings) -> Any:
    from workers.rollout.remote_dispatch import _redis

    return _redis(settings)


def send_budgeted(settings: Settings, project: str, name: str, *, args: list[Any],
                  kwargs: dict[str, Any] | None = None, argsrepr: str | None = None) -> None:
    """Queue the rollout task ``name`` for ``project`` within its budget:
    RolloutBudgetExceeded when the project has ``rollout_project_queued`` tasks queued or
    running; ConnectionError naming the broker when it cannot be reached (the place taken is
    given back)."""
    import redis

    from workers.rollout.remote_dispatch import _unreachable, send_rollout_task

    keys = _keys(settings, project)
    ticket = uuid.uuid4().hex
    now = time.time()
    try:
        taken = _client(settings).eval(_ADMIT, 1, keys.admitted, now,
                                       settings.rollout_project_queued,
                                       now + _ticket_s(settings), ticket)
    except redis.RedisError as exc:
        raise _unreachable(settings, exc) from None
    if not taken:
        raise RolloutBudgetExceeded(project, settings.rollout_project_queued)
    budget = {"project": project, "ticket": ticket}
    try:
        send_rollout_task(settings, name, args=args,
                          kwargs={**(kwargs or {}), "budget": budget}, argsrepr=argsrepr)
    except ConnectionError:
        try:
            _client(settings).zrem(keys.admitted, ticket)
        except redis.RedisError:
            pass  # the ticket expires on its own
        raise


def send_remote_budgeted(request: dict[str, Any], settings: Settings, *, answer: bool,
                         project: str) -> None:
    """:func:`workers.rollout.remote_dispatch.send_remote_rollout` within ``project``'s
    budget (:func:`send_budgeted`)."""
    from workers.rollout.remote_dispatch import REMOTE_ROLLOUT_INIT_TASK, REMOTE_ROLLOUT_TASK

    send_budgeted(settings, project, REMOTE_ROLLOUT_TASK if answer else REMOTE_ROLLOUT_INIT_TASK,
                  args=[dict(request)], argsrepr=f"(<rollout {request.get('rollout_id')!r}>,)")


def start(settings: Settings, name: str, args: list[Any], kwargs: dict[str, Any],
          budget: dict[str, Any]) -> bool:
    """Take one of the project's running places for the task ``name`` (``kwargs`` holding
    its ``budget``): True to run it now; False when it was parked instead (module
    docstring), and the worker slot is free for another project's task."""
    keys = _keys(settings, str(budget["project"]))
    now = time.time()
    message = json.dumps({"name": name, "args": args, "kwargs": {**kwargs, "budget": budget}})
    return bool(_client(settings).eval(_START, 2, keys.running, keys.parked, now,
                                       settings.rollout_project_running,
                                       now + _ticket_s(settings), str(budget["ticket"]),
                                       message))


def finish(settings: Settings, budget: dict[str, Any]) -> None:
    """Give the task's places back and queue the project's oldest parked task(s) again."""
    from workers.rollout.remote_dispatch import send_rollout_task

    keys = _keys(settings, str(budget["project"]))
    freed = _client(settings).eval(_FINISH, 3, keys.running, keys.admitted, keys.parked,
                                   time.time(), settings.rollout_project_running,
                                   str(budget["ticket"]))
    for raw in freed or []:
        message = json.loads(raw)
        send_rollout_task(settings, message["name"], args=message["args"],
                          kwargs=message["kwargs"])


def in_use(settings: Settings, project: str) -> tuple[int, int]:
    """``project``'s tasks (queued or running, running) now, for tests and the benchmark."""
    keys = _keys(settings, project)
    client = _client(settings)
    now = time.time()
    return (int(client.zcount(keys.admitted, now, "+inf")),
            int(client.zcount(keys.running, now, "+inf")))


def parked_count(settings: Settings, project: str) -> int:
    """How many of ``project``'s tasks are parked now."""
    return int(_client(settings).llen(_keys(settings, project).parked))
