"""Reward functions the dataset tests name as ``dataset_rewards:<name>``."""

from __future__ import annotations

import gc
from typing import Any

#: The episode ``raise_on`` fails on (set by the test).
FAIL_ON: list[str] = []
#: Episode id -> reward for ``table`` (set by the test).
TABLE: dict[str, float] = {}
#: Whether automatic garbage collection was on, at each call of ``collector_state``.
COLLECTOR: list[bool] = []


def recorded_or_zero(episode: Any) -> float:
    return episode.recorded_reward or 0.0


def raise_on(episode: Any) -> float:
    if episode.episode_id in FAIL_ON:
        raise RuntimeError("grader unavailable")
    return 1.0


def table(episode: Any) -> float:
    return TABLE.get(episode.episode_id, episode.recorded_reward or 0.0)


def not_a_number(episode: Any) -> Any:
    return "high"


def collector_state(episode: Any) -> float:
    COLLECTOR.append(gc.isenabled())
    return 1.0
