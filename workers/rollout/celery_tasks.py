"""Celery tasks of the rollout queue (thin shells: ids in, a function called)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from celery.signals import worker_ready, worker_shutdown

from store.errors import TransientError
from store.settings import get_settings
from workers.app import app

__all__ = ["branch_episode", "remote_rollout", "remote_rollout_init", "rollout_group"]

T = TypeVar("T")


def _within_budget(name: str, args: list[Any], kwargs: dict[str, Any],
                   budget: dict[str, Any] | None, play: Callable[[], T]) -> T | None:
    """Play the task within its project's rollout budget (:mod:`workers.rollout.fair`): when
    the project has all its running places taken, the task is parked (None returned at once,
    the worker slot free for another project) and queued again when one of them ends."""
    from workers import fair

    return fair.within(get_settings(), fair.ROLLOUT, name, args, kwargs, budget, play)


@worker_ready.connect
def _start_liveness(sender: Any = None, **_: Any) -> None:
    """A worker that consumes the ``rollout`` queue beats a heartbeat and requeues the groups
    of rollout workers whose heartbeat stopped (:mod:`workers.rollout.liveness`), from the
    moment it is ready: a worker restarted after a kill picks up its own groups."""
    if not app.conf.get("trajstore_rollout_watch"):
        return
    from workers.rollout.liveness import start_watcher

    start_watcher(get_settings())


@worker_shutdown.connect
def _stop_liveness(**_: Any) -> None:
    from workers.rollout.liveness import stop_watcher

    stop_watcher()


@app.task(name="trajstore.rollout_group", acks_late=True, autoretry_for=(TransientError,),
          retry_backoff=True, retry_backoff_max=60, max_retries=10)
def rollout_group(run_id: str, task_id: str, *, group_index: int = 0,
                  policy_version: int | None = None,
                  budget: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Roll out ``task_id``'s group in run ``run_id`` at the run's current policy version (at
    ``policy_version`` when given: the caller pins which policy plays it):
    the run's ``RunConfig`` says how many episodes and how they are played (see
    :mod:`workers.rollout.group`: a redelivery completes the group, it does not double it).
    ``group_index`` is keyword-only, so a message in the older form that carried the group
    size as a third argument fails loudly instead of playing another group. Returns the
    group's summary (None when parked: ``budget``, :func:`_within_budget`)."""
    from workers.rollout.worker import run_rollout_group

    return _within_budget(
        "trajstore.rollout_group", [run_id, task_id],
        {"group_index": group_index, "policy_version": policy_version}, budget,
        lambda: run_rollout_group(run_id, task_id, settings=get_settings(),
                                  group_index=group_index, policy_version=policy_version,
                                  lease=True).to_dict())


# Remote rollouts are acknowledged on receipt (acks_late off): one cannot be resumed half-way
# (the trainer's token buffer has moved on), so a redelivery would only find its episode
# recorded. A rollout whose worker dies is lost as the trainer's own call would be; the caller's
# timeout says so (504 from POST /rollout, the trainer's own for /v1/rollout/init), and the
# sweep finishes the idle episode.


@app.task(name="trajstore.remote_rollout", acks_late=False)
def remote_rollout(request: dict[str, Any], *, budget: dict[str, Any] | None = None
                   ) -> int | None:
    """Play the remote rollout ``request`` (``POST /rollout``) on this worker's log and push
    the answer for the request waiting on it (:func:`workers.rollout.remote.play_and_answer`).
    Returns the HTTP status answered (None when parked: :func:`_within_budget`)."""
    from workers.rollout.remote import play_and_answer
    from workers.rollout.worker import worker_log

    settings = get_settings()
    return _within_budget(
        "trajstore.remote_rollout", [request], {}, budget,
        lambda: play_and_answer(request, store=worker_log(settings),
                                settings=settings).status)


@app.task(name="trajstore.remote_rollout_init", acks_late=False)
def remote_rollout_init(request: dict[str, Any], *, budget: dict[str, Any] | None = None
                        ) -> str | None:
    """Play the remote rollout ``request`` (``POST /v1/rollout/init``) on this worker's log and
    post its RolloutResponse to the trainer
    (:func:`workers.rollout.remote.play_and_report`). Returns the response's status (None
    when the rollout id was recorded before and nothing was played, or when parked:
    :func:`_within_budget`)."""
    from workers.rollout.remote import play_and_report
    from workers.rollout.worker import worker_log

    settings = get_settings()

    def play() -> str | None:
        body = play_and_report(request, store=worker_log(settings), settings=settings)
        return None if body is None else str(body["status"])

    return _within_budget("trajstore.remote_rollout_init", [request], {}, budget, play)


@app.task(name="trajstore.branch_episode", acks_late=True, autoretry_for=(TransientError,),
          retry_backoff=True, retry_backoff_max=60, max_retries=10)
def branch_episode(episode_id: str, *, turn: int | None = None, checkpoint: str | None = None,
                   n: int | None = None, group_index: int = 0,
                   budget: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Start ``n`` episodes (default: the run's group size) from ``turn`` or ``checkpoint`` of
    the stored episode ``episode_id`` and play them (:mod:`workers.rollout.branch`; a
    redelivery completes the branch, it does not double it). Returns the group's summary
    (None when parked: :func:`_within_budget`)."""
    from workers.rollout.branch import branch_task
    from workers.rollout.liveness import group_lease

    settings = get_settings()
    kwargs = {"turn": turn, "checkpoint": checkpoint, "n": n, "group_index": group_index}

    def play() -> dict[str, Any]:
        with group_lease(settings, "trajstore.branch_episode", [episode_id], kwargs):
            return branch_task(episode_id, settings=settings, turn=turn,
                               checkpoint=checkpoint, n=n, group_index=group_index).to_dict()

    return _within_budget("trajstore.branch_episode", [episode_id], kwargs, budget, play)
