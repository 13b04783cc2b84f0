"""Celery tasks of the rollout queue (thin shells: ids in, a function called)."""

from __future__ import annotations

from typing import Any

from store.errors import TransientError
from store.settings import get_settings
from workers.app import app

__all__ = ["rollout_group"]


@app.task(name="trajstore.rollout_group", acks_late=True, autoretry_for=(TransientError,),
          retry_backoff=True, retry_backoff_max=60, max_retries=10)
def rollout_group(run_id: str, task_id: str, *, group_index: int = 0) -> dict[str, Any]:
    """Roll out ``task_id``'s group in run ``run_id`` at the run's current policy version:
    the run's ``RunConfig`` says how many episodes and how they are played (see
    :mod:`workers.rollout.group`: a redelivery completes the group, it does not double it).
    ``group_index`` is keyword-only, so a message in the older form that carried the group
    size as a third argument fails loudly instead of playing another group. Returns the
    group's summary."""
    from workers.rollout.worker import run_rollout_group

    return run_rollout_group(run_id, task_id, settings=get_settings(),
                             group_index=group_index).to_dict()
