"""Shared pieces of the trainer-worker tests: a database per test, the tiny model, runs, and
groups of real episodes recorded with the tiny model and projected into samples.

The toy task ``digits``: the user asks for digits and the reward is the share of the
response's characters that are ASCII digits (``digit_share``). The untrained tiny model writes
near-uniform byte-level tokens, about one in six of which holds a digit, so every group has
reward variance for GRPO to work with, and the share rises quickly once the policy prefers
digit tokens.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from store import migrate
from store.db import Database
from store.eventlog import NO_STREAM, EventStore, run_stream_id
from store.events import EgpoConfig, RunConfig, RunCreated
from store.settings import Settings
from workers.engines.backend import SamplingParams
from workers.engines.tinymodel import tiny_model_path
from workers.replay.jobs.project import project_episode
from workers.rollout.agent_tasks import Task
from workers.rollout.loop import run_episode
from workers.rollout.rewards import REWARDS, Reward, Transcript, register_reward
from workers.rollout.tools import ToolRegistry

__all__ = [
    "DIGITS_TASK",
    "digit_share",
    "new_run",
    "record_group",
    "tiny_model",
    "trainer_settings",
    "trainer_store",
]


def digit_share(ground_truth: Any, transcript: Transcript) -> Reward:
    """Share of the last assistant text's characters that are ASCII digits (0 when empty)."""
    text = transcript.assistant_texts[-1] if transcript.assistant_texts else ""
    share = sum(ch.isascii() and ch.isdigit() for ch in text) / len(text) if text else 0.0
    return Reward(share, {"digits": share})


if "digit_share" not in REWARDS:
    register_reward("digit_share")(digit_share)

DIGITS_TASK = Task(
    task_id="digits",
    messages=({"role": "user", "content": "Write digits only."},),
    tools=(),
    ground_truth=None,
    reward="digit_share",
    max_turns=1,
)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 model folder (built once per session)."""
    return tiny_model_path(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
def trainer_settings(tmp_path: Path, pg_server: Any) -> Iterator[Settings]:
    """Settings on a migrated database of this test's own; data under the test's folder."""
    url = pg_server.create_database()
    migrate.upgrade(url)
    yield Settings(database_url=url, data_dir=tmp_path / "data")
    pg_server.drop_database(url)


@pytest.fixture
def trainer_store(trainer_settings: Settings) -> Iterator[EventStore]:
    store = EventStore(Database(trainer_settings.database_url or "", max_size=4),
                       trainer_settings)
    yield store
    store.close()


def new_run(store: EventStore, model: Path, *, group_size: int = 4, lam: float = 0.0,
            max_negatives: int = 1, temperature: float = 1.0,
            correction: dict[str, Any] | None = None) -> str:
    """Create a run on the tiny model (GRPO when ``lam`` is 0, EGPO otherwise) whose rollouts
    sample at ``temperature``, with the off-policy ``correction`` settings (default: the
    run config's)."""
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    config = RunConfig(group_size=group_size, model=str(model), tokenizer=str(model),
                       egpo=EgpoConfig(lam=lam), rollout={"temperature": temperature},
                       negatives={"max_negative_samples_per_group": max_negatives},
                       **({} if correction is None else {"correction": correction}))
    store.append(run_stream_id(run_id), [RunCreated(run_id=run_id, config=config)], NO_STREAM)
    return run_id


def record_group(store: EventStore, backend: Any, run_id: str, *, size: int, seed: int,
                 task: Task = DIGITS_TASK, max_tokens: int = 8, temperature: float = 1.0,
                 group_id: str | None = None) -> list[float]:
    """Play ``size`` episodes of ``task`` with ``backend`` into the store as one group,
    project each, and return their rewards."""
    group = group_id or f"{run_id}:g{seed}"
    rewards = []
    for index in range(size):
        result = run_episode(
            task=task, backend=backend, tools=ToolRegistry([]), sink=store, run_id=run_id,
            group_id=group, sampling=SamplingParams(temperature=temperature,
                                                    max_tokens=max_tokens,
                                                    seed=seed * 1000 + index))
        outcome = project_episode(store, result.episode_id)
        assert outcome.outcome == "written", outcome
        rewards.append(result.reward.value)
    return rewards
