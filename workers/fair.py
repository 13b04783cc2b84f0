"""Per-project budgets on the shared queues, kept in Redis (the broker).

Every budgeted task (a rollout, a replay) carries a *budget* in its keyword arguments: its
project and a ticket, ``{"project": ..., "ticket": ...}``. Each project has a number of
*places* for each :class:`Kind` of task (the kind's setting: ``rollout_project_running``,
``replay_project_running``), and a task runs only while its ticket holds one.

- **Taking a place** (:func:`take`): a ticket that holds a place keeps it (a redelivery of a
  running task, a message queued again by a hand-on); else it takes a free place; else its
  message is *parked* on the project's Redis list (once: a ticket parked already is not parked
  again), and the caller neither runs nor sends it; else, when the kind bounds what a project
  parks (``replay_project_parked``) and the list is that long, it is *refused*: neither run,
  sent nor parked (a replay so refused is left to the sweep, which finds every finished,
  unprojected episode in PostgreSQL and offers it again). A rollout worker takes the place when the
  task starts (:func:`start`), so a parked task leaves its worker slot to the next message of
  the queue; the replay dispatcher takes it before it sends the task (:func:`send`), so a
  project has at most its places' worth of replays queued or running, and another project's
  episode waits behind that many at most, however few the worker slots.
- **Handing it on** (:func:`finish`, when the task ends, returned or raised): the place is
  given back and handed to the project's oldest parked tickets, whose messages are queued
  again at the tail of the kind's queue, behind what other projects queued meanwhile.

Nothing parked is lost:

- Taking, parking and handing on are single Lua scripts: a task is never parked while its
  project has a free place, so none waits for a hand-on that will not come.
- A hand-on sends the message before it leaves the list: the script takes the place for the
  parked ticket and marks it *releasing* for :data:`RELEASE_GRACE_S` seconds, the message is
  queued, and only then is it taken off the list. A process that dies in between leaves it
  there, and the next hand-on after the grace queues it again (twice at worst: replays are
  idempotent, a rollout's redelivery completes what was recorded).
- A place expires after :func:`ticket_s` (twice the broker's visibility timeout, by which a
  task lost with its worker has been delivered again): a ticket whose task never ends frees
  its place by itself, and :func:`release_stranded` (the sweep) hands such places on where no
  task of the project ends to do it.

Tasks without a budget (sent by an older producer) run unbudgeted.

Only replays are refused past a cap: the log, not Redis, is the truth of what is due, so a
project's parked list need only hold what its places will take next. A rollout parked is
its only copy, and rollouts are admitted within ``rollout_project_queued`` instead
(:func:`admit`, 429 past it), which bounds their list.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from store.settings import Settings
from workers import broker

__all__ = ["KINDS", "MAX_DEFAULT_REPLAY", "RELEASE_GRACE_S", "REPLAY", "ROLLOUT", "Keys", "Kind",
           "admit", "default_replay_slots", "finish", "in_hand", "keys", "offer",
           "parked_count", "places_held", "release_stranded", "send", "start", "take",
           "ticket_s", "within"]

#: Most replay processes a replay worker starts without ``--concurrency``.
MAX_DEFAULT_REPLAY = 32


def default_replay_slots(settings: Any) -> int:
    """The slots of a replay-only worker started without ``--concurrency``:
    ``replay_project_running + 1``, so that a project holding all its replay places (a
    template rendering at its budget, a burst of episodes) leaves one slot to the next
    project's episode, at most ``MAX_DEFAULT_REPLAY`` (a setting that turns the budget off,
    100000, starts no more processes than that)."""
    return min(int(settings.replay_project_running) + 1, MAX_DEFAULT_REPLAY)

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds a hand-on has to queue a parked message before another may queue it again.
RELEASE_GRACE_S = 60.0


@dataclass(frozen=True)
class Kind:
    """A kind of budgeted task: ``name`` in its Redis keys, ``setting`` the field of
    :class:`~store.settings.Settings` that holds its places per project, ``queue`` the Celery
    queue its parked messages are queued on again, ``parked_setting`` the field that bounds
    the tasks one project parks (None: unbounded here)."""

    name: str
    setting: str
    queue: str
    parked_setting: str | None = None

    def places(self, settings: Settings) -> int:
        """The places per project the settings give."""
        return int(getattr(settings, self.setting))

    def parked_cap(self, settings: Settings) -> int:
        """The most tasks one project parks (0: no cap)."""
        return int(getattr(settings, self.parked_setting)) if self.parked_setting else 0


ROLLOUT = Kind("rollout", "rollout_project_running", "rollout")
REPLAY = Kind("replay", "replay_project_running", "replay", "replay_project_parked")
KINDS = (ROLLOUT, REPLAY)


@dataclass(frozen=True)
class Keys:
    """A project's Redis keys for one kind: ``running`` the places held (ticket → expiry),
    ``parked`` the parked messages (oldest first), ``parked_tickets`` their tickets,
    ``releasing`` the hand-ons in progress (ticket → deadline), ``admitted`` the tickets
    admitted by :func:`admit` (ticket → expiry)."""

    running: str
    parked: str
    parked_tickets: str
    releasing: str
    admitted: str


def _base(settings: Settings, kind: Kind) -> str:
    return f"{settings.redis_key_prefix}{kind.name}-budget:"


def keys(settings: Settings, kind: Kind, project: str) -> Keys:
    """``project``'s keys for ``kind``."""
    base = f"{_base(settings, kind)}{project}:"
    return Keys(base + "running", base + "parked", base + "parked-tickets",
                base + "releasing", base + "admitted")


def ticket_s(settings: Settings) -> float:
    """How long a ticket holds its place when its task never ends (its worker died): twice
    the broker's visibility timeout, after which a lost task is redelivered."""
    return 2.0 * settings.visibility_timeout_s


def _client(settings: Settings) -> Any:
    return broker.redis_client(settings)


def _message(name: str, args: list[Any], kwargs: dict[str, Any], budget: dict[str, Any]
             ) -> str:
    return json.dumps({"name": name, "args": args, "kwargs": {**kwargs, "budget": budget}})


# KEYS: admitted. ARGV: now, limit, expiry, ticket. 1 admitted, 0 at the limit.
_ADMIT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[4])
return 1
"""

# KEYS: running, parked, parked tickets. ARGV: now, places, expiry, ticket, message, cap.
# 2: the ticket held a place already (its expiry renewed); 1: it took a free one; 0: it is
# parked (now, or it was already); -1: refused, the project has cap (> 0) parked already.
_TAKE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZSCORE', KEYS[1], ARGV[4]) then
  redis.call('ZADD', KEYS[1], ARGV[3], ARGV[4])
  return 2
end
if redis.call('SISMEMBER', KEYS[3], ARGV[4]) == 1 then return 0 end
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[2]) then
  redis.call('ZADD', KEYS[1], ARGV[3], ARGV[4])
  return 1
end
if tonumber(ARGV[6]) > 0 and redis.call('LLEN', KEYS[2]) >= tonumber(ARGV[6]) then
  return -1
end
redis.call('RPUSH', KEYS[2], ARGV[5])
redis.call('SADD', KEYS[3], ARGV[4])
return 0
"""

# KEYS: running, parked, parked tickets, releasing, admitted. ARGV: now, places, expiry,
# ticket ending ('' for none), release deadline. Gives the ticket's place back and hands the
# free places to the oldest parked tickets not being released by another call (a ticket whose
# release outlived its grace is handed on again, on the place it holds when it still holds
# one). Returns their messages, to be queued and then confirmed (_CONFIRM).
_RELEASE = """
if ARGV[4] ~= '' then
  redis.call('ZREM', KEYS[1], ARGV[4])
  redis.call('ZREM', KEYS[5], ARGV[4])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', ARGV[1])
local free = tonumber(ARGV[2]) - redis.call('ZCARD', KEYS[1])
local out = {}
local i = 0
while free > 0 do
  local m = redis.call('LINDEX', KEYS[2], i)
  if not m then break end
  local t = tostring(cjson.decode(m)['kwargs']['budget']['ticket'])
  if not redis.call('ZSCORE', KEYS[4], t) then
    if not redis.call('ZSCORE', KEYS[1], t) then
      redis.call('ZADD', KEYS[1], ARGV[3], t)
      free = free - 1
    end
    redis.call('ZADD', KEYS[4], ARGV[5], t)
    table.insert(out, m)
  end
  i = i + 1
end
return out
"""

# KEYS: parked, parked tickets, releasing. ARGV: message, ticket, message, ticket, ...
_CONFIRM = """
for i = 1, #ARGV, 2 do
  redis.call('LREM', KEYS[1], 1, ARGV[i])
  redis.call('SREM', KEYS[2], ARGV[i + 1])
  redis.call('ZREM', KEYS[3], ARGV[i + 1])
end
return 1
"""


def admit(settings: Settings, kind: Kind, project: str, ticket: str, limit: int, *,
          now: float | None = None) -> bool:
    """Count ``ticket`` among ``project``'s admitted tasks of ``kind`` unless it has ``limit``
    admitted already (False); an admitted ticket leaves the count when its task ends
    (:func:`finish`) or after :func:`ticket_s`. Raises redis' errors."""
    k = keys(settings, kind, project)
    now = time.time() if now is None else now
    return bool(_client(settings).eval(_ADMIT, 1, k.admitted, now, limit,
                                       now + ticket_s(settings), ticket))


def take(settings: Settings, kind: Kind, name: str, args: list[Any], kwargs: dict[str, Any],
         budget: dict[str, Any], *, now: float | None = None) -> int:
    """Take one of the project's places for the task ``name`` (``args``, ``kwargs``) under
    ``budget``: 2 when its ticket held one already (its expiry renewed), 1 when it took a
    free one, 0 when the task is parked (now, or before: its message waits once on the
    project's list), -1 when it is refused: the project has the kind's cap parked already
    (:meth:`Kind.parked_cap`), and the task is neither placed nor parked. Raises redis'
    errors; KeyError for a budget without project or ticket."""
    k = keys(settings, kind, str(budget["project"]))
    now = time.time() if now is None else now
    budget = {"project": str(budget["project"]), "ticket": str(budget["ticket"])}
    return int(_client(settings).eval(
        _TAKE, 3, k.running, k.parked, k.parked_tickets, now, kind.places(settings),
        now + ticket_s(settings), budget["ticket"], _message(name, args, kwargs, budget),
        kind.parked_cap(settings)))


def start(settings: Settings, kind: Kind, name: str, args: list[Any], kwargs: dict[str, Any],
          budget: dict[str, Any], *, now: float | None = None) -> bool:
    """:func:`take` in the worker: True to run the task now, False when it is parked or
    refused (the worker slot is free for the next message)."""
    return take(settings, kind, name, args, kwargs, budget, now=now) > 0


def send(settings: Settings, kind: Kind, name: str, args: list[Any], kwargs: dict[str, Any],
         *, project: str, ticket: str, now: float | None = None) -> bool:
    """Queue the task ``name`` on the kind's queue within ``project``'s places, ``ticket``
    naming it: True when it was queued (on a place taken now, or held by the ticket
    already: a send repeated after its sender died), False when it was parked instead
    (queued again when a place frees) or refused (:func:`offer`). ConnectionError naming
    the broker when it cannot be reached (a place taken for the send is given back)."""
    return offer(settings, kind, name, args, kwargs, project=project, ticket=ticket,
                 now=now) > 0


def offer(settings: Settings, kind: Kind, name: str, args: list[Any], kwargs: dict[str, Any],
          *, project: str, ticket: str, now: float | None = None) -> int:
    """:func:`send`, answering what became of the task as :func:`take` does: 2 or 1 queued,
    0 parked, -1 refused (the project has the kind's cap parked already: nothing is kept of
    it, and its producer offers it again later). ConnectionError naming the broker when it
    cannot be reached."""
    import redis

    budget = {"project": project, "ticket": ticket}
    try:
        taken = take(settings, kind, name, args, kwargs, budget, now=now)
    except redis.RedisError as exc:
        raise broker.unreachable(settings, exc) from None
    if taken <= 0:
        return taken
    try:
        broker.send_task(settings, name, queue=kind.queue, args=args,
                         kwargs={**kwargs, "budget": budget}, pooled=True)
    except ConnectionError:
        if taken == 1:
            try:
                _client(settings).zrem(keys(settings, kind, project).running, ticket)
            except redis.RedisError:
                pass  # the place expires by itself
        raise
    return taken


def _hand_on(settings: Settings, kind: Kind, project: str, ticket: str,
             now: float | None) -> int:
    """Give ``ticket``'s place back ('' for none) and queue the parked messages that take the
    free places; returns how many were queued. Raises redis' errors and ConnectionError
    (what was queued before the error is confirmed; the rest waits its grace)."""
    k = keys(settings, kind, project)
    now = time.time() if now is None else now
    client = _client(settings)
    freed = client.eval(_RELEASE, 5, k.running, k.parked, k.parked_tickets, k.releasing,
                        k.admitted, now, kind.places(settings), now + ticket_s(settings),
                        ticket, now + RELEASE_GRACE_S) or []
    sent: list[Any] = []
    try:
        for raw in freed:
            message = json.loads(raw)
            broker.send_task(settings, message["name"], queue=kind.queue,
                             args=message["args"], kwargs=message["kwargs"], pooled=True)
            sent += [raw, str(message["kwargs"]["budget"]["ticket"])]
    finally:
        if sent:
            client.eval(_CONFIRM, 3, k.parked, k.parked_tickets, k.releasing, *sent)
    return len(sent) // 2


def finish(settings: Settings, kind: Kind, budget: dict[str, Any], *,
           now: float | None = None) -> int:
    """The task under ``budget`` ended: give its place (and its admission) back and queue the
    project's oldest parked tasks on the places free now; returns how many were queued. A
    broker that cannot be reached is logged, not raised (the task's work is done; its place
    expires after :func:`ticket_s` and the sweep hands it on, :func:`release_stranded`)."""
    import redis

    try:
        return _hand_on(settings, kind, str(budget["project"]), str(budget["ticket"]), now)
    except (redis.RedisError, ConnectionError) as exc:
        log.warning("%s budget of project %r: could not hand on its place (%s); the sweep "
                    "will", kind.name, budget.get("project"), exc)
        return 0


def within(settings: Settings, kind: Kind, name: str, args: list[Any], kwargs: dict[str, Any],
           budget: dict[str, Any] | None, play: Callable[[], T]) -> T | None:
    """Play the task within its project's budget of ``kind``: at once without a budget;
    else None at once when it is parked (:func:`start`), or ``play()`` and then
    :func:`finish`, whether it returns or raises."""
    if budget is None:
        return play()
    if not start(settings, kind, name, args, kwargs, budget):
        return None
    try:
        return play()
    finally:
        finish(settings, kind, budget)


def _projects_with_parked(settings: Settings, kind: Kind) -> list[str]:
    base = _base(settings, kind)
    # SCAN's pattern is a glob: the prefix's own glob characters are escaped.
    pattern = "".join("\\" + c if c in "*?[]\\" else c for c in base) + "*:parked"
    found = []
    for key in _client(settings).scan_iter(match=pattern, count=500):
        text = key.decode() if isinstance(key, bytes) else str(key)
        found.append(text[len(base):-len(":parked")])
    return sorted(set(found))


def release_stranded(settings: Settings, kinds: Iterable[Kind] = KINDS, *,
                     now: float | None = None) -> int:
    """Hand on every place free now to the parked tasks of every project (what
    :func:`finish` does when a task ends, for projects where the tasks that held the places
    never ended: their places expired). Returns how many were queued; raises redis' errors
    and ConnectionError."""
    queued = 0
    for kind in kinds:
        for project in _projects_with_parked(settings, kind):
            queued += _hand_on(settings, kind, project, "", now)
    return queued


def in_hand(settings: Settings, kind: Kind, tickets: Sequence[tuple[str, str]], *,
            now: float | None = None) -> set[str]:
    """Of ``(project, ticket)`` pairs, the tickets the budget holds now: on a place (queued
    or running) or parked. Raises redis' errors."""
    if not tickets:
        return set()
    now = time.time() if now is None else now
    with _client(settings).pipeline(transaction=False) as pipe:
        for project, ticket in tickets:
            k = keys(settings, kind, project)
            pipe.zscore(k.running, ticket)
            pipe.sismember(k.parked_tickets, ticket)
        answers = pipe.execute()
    held = set()
    for i, (_, ticket) in enumerate(tickets):
        expiry, parked = answers[2 * i], answers[2 * i + 1]
        if (expiry is not None and float(expiry) > now) or parked:
            held.add(ticket)
    return held


def places_held(settings: Settings, kind: Kind, project: str, *,
                now: float | None = None) -> int:
    """``project``'s places of ``kind`` held now (queued or running tasks)."""
    now = time.time() if now is None else now
    return int(_client(settings).zcount(keys(settings, kind, project).running, f"({now}",
                                        "+inf"))


def parked_count(settings: Settings, kind: Kind, project: str) -> int:
    """How many of ``project``'s tasks of ``kind`` are parked now."""
    return int(_client(settings).llen(keys(settings, kind, project).parked))
