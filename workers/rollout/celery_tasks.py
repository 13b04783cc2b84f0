"""Celery tasks of the rollout queue (thin shells: ids in, a function called)."""

from __future__ import annotations

from typing import Any

from store.errors import TransientError
from store.settings import get_settings
from workers.app import app

__all__ = ["rollout_group"]


@app.task(name="trajstore.rollout_group", acks_late=True, autoretry_for=(TransientError,),
          retry_backoff=True, retry_backoff_max=60, max_retries=10)
def rollout_group(run_id: str, task_id: str, n: int, group_index: int = 0) -> dict[str, Any]:
    """Roll out the ``n`` episodes of ``task_id``'s group in run ``run_id`` at the run's
    current policy version (see :mod:`workers.rollout.group`: a redelivery completes the
    group, it does not double it). Returns the group's summary."""
    from workers.rollout.worker import run_rollout_group

    return run_rollout_group(run_id, task_id, n, settings=get_settings(),
                             group_index=group_index).to_dict()
