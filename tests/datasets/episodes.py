"""A run recorded for the dataset tests: episodes of several groups, tasks and statuses, one
with a rolled-back failure (a negative sample), one unfinished, one without a reward."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from test_replay_project_batch import rollback_episode
from test_replay_reuse import tool_episode

from store.eventlog import NO_STREAM, EventStore, run_stream_id
from store.events import EpisodeFinished, EpisodeStarted, RewardAssigned, RunConfig, RunCreated

__all__ = ["RecordedRun", "record_run"]


@dataclass
class RecordedRun:
    run_id: str
    episodes: dict[str, str]  # label -> episode id


def record_run(store: EventStore, tok, *, project: str = "default") -> RecordedRun:
    """Episodes by label: ``a0`` (2 turns, reward 1, group g0, task t-a), ``a1`` (1 turn,
    reward 0, g0, t-a), ``fail`` (a TypeError rolled back: a negative sample; reward 1, g1,
    t-b), ``err`` (3 turns, status error, reward 0, g1, t-b), ``open`` (unfinished, g2) and
    ``bare`` (finished without a reward, g2)."""
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    config = RunConfig.model_validate({"tokenizer": "qwen3", "group_size": 2,
                                       "rollback": {"save_negative_samples": True}})
    store.append(run_stream_id(run_id), [RunCreated(run_id=run_id, project=project,
                                                    config=config)], NO_STREAM)
    specs = {
        "a0": (tool_episode(tok, turns=2, reasoning=False, seed=1), "g0", "t-a", 1.0, None),
        "a1": (tool_episode(tok, turns=1, reasoning=True, seed=2), "g0", "t-a", 0.0, None),
        "fail": (rollback_episode(tok), "g1", "t-b", 1.0, None),
        "err": (tool_episode(tok, turns=3, reasoning=False, seed=3), "g1", "t-b", 0.0,
                "error"),
        "open": (tool_episode(tok, turns=1, reasoning=False, seed=4), "g2", "t-c", None,
                 "open"),
        "bare": (tool_episode(tok, turns=1, reasoning=False, seed=5), "g2", "t-c", None,
                 None),
    }
    episodes = {}
    for label, (events, group, task, reward, status) in specs.items():
        started = events[0]
        assert isinstance(started, EpisodeStarted)
        body = [e for e in events[1:] if not isinstance(e, (RewardAssigned, EpisodeFinished))]
        tail: list = []
        if reward is not None:
            tail.append(RewardAssigned(value=reward))
        if status != "open":
            tail.append(EpisodeFinished(status=status or "completed"))
        episode_id = f"{label}-{uuid.uuid4().hex[:8]}"
        store.append(episode_id, [started.model_copy(update={
            "run_id": run_id, "group_id": group, "task_id": task}), *body, *tail], NO_STREAM)
        episodes[label] = episode_id
    return RecordedRun(run_id, episodes)
