"""Celery tasks of the rollout queue."""

from __future__ import annotations

__all__: list[str] = []
