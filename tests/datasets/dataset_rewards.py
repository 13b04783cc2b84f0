"""Reward functions the dataset tests name as ``dataset_rewards:<name>``."""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path
from typing import Any

#: The episode ``raise_on`` fails on (set by the test).
FAIL_ON: list[str] = []
#: Episode id -> reward for ``table`` (set by the test).
TABLE: dict[str, float] = {}
#: Whether automatic garbage collection was on, at each call of ``collector_state``.
COLLECTOR: list[bool] = []


def llm_calls(episode: Any) -> float:
    """The number of the episode's LLM calls (it must be given every event)."""
    return float(sum(e.type == "llm_called" for e in episode.events))


def recorded_or_zero(episode: Any) -> float:
    return episode.recorded_reward or 0.0


#: A file of episode ids ``raise_on`` fails on too, one per line (for derivations replayed in
#: other processes: the API's derivation pool, spawned, does not share ``FAIL_ON``).
FAIL_ON_FILE = "DATASET_REWARDS_FAIL_ON_FILE"
#: A file ``gated`` writes its process id to, and the file whose existence lets it return.
GATE_FILES = "DATASET_REWARDS_GATE"


def fail_on(*episode_ids: str) -> None:
    """Make ``raise_on`` fail on ``episode_ids``, in this process and in those that read
    the file ``$DATASET_REWARDS_FAIL_ON_FILE`` names."""
    FAIL_ON[:] = list(episode_ids)
    path = os.environ.get(FAIL_ON_FILE)
    if path:
        Path(path).write_text("".join(f"{e}\n" for e in episode_ids))


def raise_on(episode: Any) -> float:
    path = os.environ.get(FAIL_ON_FILE)
    listed = Path(path).read_text().split() if path and Path(path).exists() else []
    if episode.episode_id in FAIL_ON or episode.episode_id in listed:
        raise RuntimeError("grader unavailable")
    return 1.0


def gated(episode: Any) -> float:
    """1.0, once the file ``$DATASET_REWARDS_GATE.open`` exists (at most 120 s); writes
    this process's id to ``$DATASET_REWARDS_GATE.started`` first."""
    gate = os.environ[GATE_FILES]
    Path(f"{gate}.started").write_text(str(os.getpid()))
    deadline = time.monotonic() + 120
    while not Path(f"{gate}.open").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return 1.0


def table(episode: Any) -> float:
    return TABLE.get(episode.episode_id, episode.recorded_reward or 0.0)


def not_a_number(episode: Any) -> Any:
    return "high"


def collector_state(episode: Any) -> float:
    COLLECTOR.append(gc.isenabled())
    return 1.0
