"""Per-project budgets on the shared rollout queue: :mod:`workers.fair` for rollout tasks.

Every rollout task a project sends (a remote rollout of ``POST /rollout`` or ``POST
/v1/rollout/init``, a branch, a group) carries a *budget*: its project and a ticket.

- **Admission** (:func:`send_budgeted`, at the sender): a project holds at most
  ``rollout_project_queued`` tasks queued or running at once (:func:`workers.fair.admit`, each
  ticket expiring after :func:`workers.fair.ticket_s` so a task lost with its worker frees its
  place). One more is refused with :class:`RolloutBudgetExceeded` naming the setting; the API
  answers it 429.
- **Running** (:func:`start`, in the worker): at most ``rollout_project_running`` of one
  project's tasks run at once (the places of :data:`workers.fair.ROLLOUT`). A task that finds
  its project at the cap does not hold the worker slot: it is *parked* (its message kept on the
  project's Redis list) and the slot goes to the next message of the queue, which is another
  project's as soon as the flooding project's messages are parked. When one of the project's
  tasks ends (:func:`finish`), its place goes to the oldest parked task, queued again at the
  queue's tail. So a project with many slow rollouts has ``rollout_project_running`` worker
  slots, and every other project finds the others free.

How a parked task is kept from being lost (a worker that dies, a redelivery) is
:mod:`workers.fair`'s. Tasks without a budget (sent by an older producer) run unbudgeted.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from store.settings import Settings
from workers import broker, fair

__all__ = ["RolloutBudgetExceeded", "finish", "in_use", "parked_count", "send_budgeted",
           "send_remote_budgeted",
           "start"]


class RolloutBudgetExceeded(Exception):
    """A project has ``limit`` rollout tasks queued or running already; the message names the
    setting."""

    def __init__(self, project: str, limit: int) -> None:
        super().__init__(
            f"project {project!r} has {limit} rollout(s) queued or running already, the limit "
            "(setting TRAJSTORE_ROLLOUT_PROJECT_QUEUED); retry when some have finished")
        self.project = project
        self.limit = limit


def send_budgeted(settings: Settings, project: str, name: str, *, args: list[Any],
                  kwargs: dict[str, Any] | None = None, argsrepr: str | None = None) -> None:
    """Queue the rollout task ``name`` for ``project`` within its budget:
    RolloutBudgetExceeded when the project has ``rollout_project_queued`` tasks queued or
    running; ConnectionError naming the broker when it cannot be reached (the place taken is
    given back)."""
    import redis

    from workers.rollout.remote_dispatch import send_rollout_task

    ticket = uuid.uuid4().hex
    try:
        taken = fair.admit(settings, fair.ROLLOUT, project, ticket,
                           settings.rollout_project_queued)
    except redis.RedisError as exc:
        raise broker.unreachable(settings, exc) from None
    if not taken:
        raise RolloutBudgetExceeded(project, settings.rollout_project_queued)
    budget = {"project": project, "ticket": ticket}
    try:
        send_rollout_task(settings, name, args=args,
                          kwargs={**(kwargs or {}), "budget": budget}, argsrepr=argsrepr)
    except ConnectionError:
        try:
            broker.redis_client(settings).zrem(
                fair.keys(settings, fair.ROLLOUT, project).admitted, ticket)
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
    return fair.start(settings, fair.ROLLOUT, name, args, kwargs, budget)


def finish(settings: Settings, budget: dict[str, Any]) -> None:
    """Give the task's places back and queue the project's oldest parked task(s) again."""
    fair.finish(settings, fair.ROLLOUT, budget)


def in_use(settings: Settings, project: str) -> tuple[int, int]:
    """``project``'s tasks (queued or running, running) now, for tests and the benchmark;
    a parked task handed a place counts as running from the hand-on."""
    now = time.time()
    k = fair.keys(settings, fair.ROLLOUT, project)
    return (int(broker.redis_client(settings).zcount(k.admitted, now, "+inf")),
            fair.places_held(settings, fair.ROLLOUT, project, now=now))


def parked_count(settings: Settings, project: str) -> int:
    """How many of ``project``'s tasks are parked now."""
    return fair.parked_count(settings, fair.ROLLOUT, project)
