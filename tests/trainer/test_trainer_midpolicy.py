"""Rollouts across policy updates (``rollout.continue_across_updates``): an episode in flight
when the trainer publishes a policy continues on it, each LLM call keeps its own version and
log-probs, replay carries them per token, and the step's staleness counts calls."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pydantic
import pytest
import trainer_episodes
from trainer_episodes import record_group

from store.eventlog import NO_STREAM, run_stream_id
from store.events import LLMCalled, RolloutConfig, RunConfig, RunCreated
from store.serving import call_policy_versions
from store.stored_sample import from_row
from tests.rollout.turns import tool_call, turn
from workers.engines.backend_replay import ReplayBackend
from workers.engines.backend_transformers import TransformersBackend
from workers.replay.jobs.project import project_episode
from workers.rollout.agent_tasks import Task
from workers.rollout.group_log import StoreGroupLog
from workers.rollout.loop import arun_episode
from workers.rollout.runtime import WeightsGate
from workers.rollout.tools import ToolOutcome, ToolRegistry, function_schema
from workers.rollout.worker import _on_newest_policy
from workers.rollout.worker_engine import RolloutEngine
from workers.trainer.config import TrainerConfig
from workers.trainer.loop import Trainer, call_staleness_metrics

tiny_model = trainer_episodes.tiny_model
trainer_settings = trainer_episodes.trainer_settings
trainer_store = trainer_episodes.trainer_store


class Publish:
    """A tool whose first run is a training step: the trainer publishes a new policy while
    the episode that called it is in flight."""

    name = "publish"
    schema = function_schema("publish", description="publish a policy", properties={})

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.versions: list[int | None] = []

    def __call__(self, arguments: dict[str, Any]) -> ToolOutcome:
        if not self.versions:
            self.versions.append(self.trainer.step().version)
        return ToolOutcome(output="ok")


def _run(store: Any, model: Path, *, continue_across_updates: bool) -> str:
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    config = RunConfig(group_size=2, model=str(model), tokenizer=str(model),
                       rollout=RolloutConfig(continue_across_updates=continue_across_updates))
    store.append(run_stream_id(run_id), [RunCreated(run_id=run_id, config=config)], NO_STREAM)
    return run_id


def _play(store: Any, run_id: str, engine: RolloutEngine, tool: Publish, *,
          guarded: bool) -> list[str]:
    """Two episodes of one group, two calls each (a tool call, then digits), on ``engine``
    held at the run's newest policy, as the rollout worker plays them."""
    log = StoreGroupLog(store)
    gate = WeightsGate()
    task = Task(task_id="publish", messages=({"role": "user", "content": "Go."},),
                tools=(Publish.schema,), ground_truth=None, reward="digit_share", max_turns=2)

    async def play() -> list[str]:
        policy = log.policy(run_id)
        ids = []
        async with gate.hold((id(engine), run_id, policy.version),
                             lambda: engine.ensure(run_id, policy, report=log.policy_served)):
            for _ in range(2):
                script = ReplayBackend(engine.backend,  # type: ignore[arg-type]
                                       [turn("go", tool_call("publish")), "1234"])
                result = await arun_episode(
                    task=task, backend=script, tools=ToolRegistry([tool]), sink=store,
                    run_id=run_id, group_id=f"{run_id}:mid", max_turns=2,
                    call_guard=(lambda: _on_newest_policy(gate, engine, log, run_id))
                    if guarded else None)
                assert result.status == "completed", result
                ids.append(result.episode_id)
        return ids

    ids = asyncio.run(play())
    for episode_id in ids:
        assert project_episode(store, episode_id).outcome == "written"
    return ids


def _calls(store: Any, episode_id: str) -> list[LLMCalled]:
    return [r.event for r in store.read_stream(episode_id) if isinstance(r.event, LLMCalled)]


def _sample(store: Any, episode_id: str) -> Any:
    with store.db.connection() as conn:
        cursor = conn.execute("SELECT * FROM samples WHERE episode_id = %s AND kind = 'positive'",
                              [episode_id])
        names = [c.name for c in cursor.description]
        rows = [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
    assert len(rows) == 1
    return from_row(rows[0])


def test_an_episode_continues_on_the_policy_published_while_it_plays(
        trainer_store, tiny_model: Path) -> None:
    run_id = _run(trainer_store, tiny_model, continue_across_updates=True)
    base = TransformersBackend(tiny_model)
    record_group(trainer_store, base, run_id, size=2, seed=1)  # what the first step trains
    trainer = Trainer.open(trainer_store, run_id, config=TrainerConfig(
        lr=5e-2, groups_per_step=1, micro_batch_size=2))
    engine = RolloutEngine(TransformersBackend(tiny_model), kind="transformers",
                           model_dir=tiny_model)
    tool = Publish(trainer)

    first, second = _play(trainer_store, run_id, engine, tool, guarded=True)

    assert tool.versions == [1] and engine.loaded == (run_id, 1)
    # Each call records the version that generated it: the first episode spans 0 and 1.
    assert [c.policy_version for c in _calls(trainer_store, first)] == [0, 1]
    assert [c.policy_version for c in _calls(trainer_store, second)] == [1, 1]
    assert call_policy_versions(trainer_store, [first, second, "nothing"]) == {
        first: [0, 1], second: [1, 1]}

    # Replay gives one sample whose tokens carry each call's own log-probs.
    call_1, call_2 = _calls(trainer_store, first)
    sample = _sample(trainer_store, first)
    tokens, logprobs = sample.token_ids, sample.logprobs
    at_1 = len(call_1.prompt_ids)
    span_1 = slice(at_1, at_1 + len(call_1.response_ids))
    span_2 = slice(len(tokens) - len(call_2.response_ids), len(tokens))
    assert list(tokens[span_1]) == list(call_1.response_ids)
    assert list(tokens[span_2]) == list(call_2.response_ids)
    np.testing.assert_array_equal(logprobs[span_1], call_1.logprobs)
    np.testing.assert_array_equal(logprobs[span_2], call_2.logprobs)
    assert sample.loss_mask[span_1].all() and sample.loss_mask[span_2].all()

    # At zero staleness for each call (the weights that generated it), the importance ratio
    # of every token is 1; under the other version it is not (the versions differ).
    v0 = base.score(call_1.prompt_ids.tolist(), call_1.response_ids.tolist())
    v1 = engine.backend.score(call_2.prompt_ids.tolist(), call_2.response_ids.tolist())  # type: ignore[attr-defined]
    np.testing.assert_allclose(np.exp(v0 - logprobs[span_1]), 1.0, atol=1e-3)
    np.testing.assert_allclose(np.exp(v1 - logprobs[span_2]), 1.0, atol=1e-3)
    v1_on_call_1 = engine.backend.score(call_1.prompt_ids.tolist(),  # type: ignore[attr-defined]
                                        call_1.response_ids.tolist())
    assert np.abs(v1_on_call_1 - logprobs[span_1]).max() > 1e-3

    # The next step (at version 1) trains the group: its staleness counts calls.
    step = trainer.step()
    assert step.version == 2
    assert step.metrics["calls"] == 4.0 and step.metrics["calls_stale"] == 1.0
    assert step.metrics["episodes_mixed_versions"] == 1.0
    assert step.metrics["call_version_gap_min"] == 0.0
    assert step.metrics["call_version_gap_max"] == 1.0
    assert step.metrics["call_version_gap_mean"] == 0.25
    # Episodes: both samples carry their last call's version, 1.
    assert step.metrics["version_gap_max"] == 0.0


def test_without_the_option_an_episode_stays_on_its_version(trainer_store,
                                                            tiny_model: Path) -> None:
    run_id = _run(trainer_store, tiny_model, continue_across_updates=False)
    record_group(trainer_store, TransformersBackend(tiny_model), run_id, size=2, seed=1)
    trainer = Trainer.open(trainer_store, run_id, config=TrainerConfig(
        lr=5e-2, groups_per_step=1, micro_batch_size=2))
    engine = RolloutEngine(TransformersBackend(tiny_model), kind="transformers",
                           model_dir=tiny_model)
    tool = Publish(trainer)

    first, second = _play(trainer_store, run_id, engine, tool, guarded=False)

    assert tool.versions == [1] and engine.loaded == (run_id, 0)
    assert call_policy_versions(trainer_store, [first, second]) == {first: [0, 0],
                                                                    second: [0, 0]}
    step = trainer.step()
    assert step.metrics["calls"] == 4.0 and step.metrics["calls_stale"] == 4.0
    assert step.metrics["episodes_mixed_versions"] == 0.0


def test_the_option_is_refused_with_a_sampling_seed() -> None:
    with pytest.raises(pydantic.ValidationError, match="continue_across_updates"):
        RunConfig.model_validate({"rollout": {"continue_across_updates": True, "seed": 3}})
    assert not RunConfig().rollout.continue_across_updates
    assert "continue_across_updates" not in RunConfig.model_validate(
        {"rollout": {"seed": 3}}).rollout.model_dump(exclude_defaults=True)


def test_call_staleness_metrics() -> None:
    assert call_staleness_metrics({"a": [0, 1], "b": [1]}, 1) == {
        "calls": 3.0, "calls_stale": 1.0, "episodes_mixed_versions": 1.0,
        "call_version_gap_min": 0.0, "call_version_gap_mean": 1 / 3,
        "call_version_gap_max": 1.0}
    assert call_staleness_metrics({}, 4) == {"calls": 0.0, "calls_stale": 0.0,
                                             "episodes_mixed_versions": 0.0}


def test_new_weights_wait_for_the_call_in_flight_and_never_replace_another_run() -> None:
    gate = WeightsGate()
    loads: list[str] = []

    def same_run_older(run: str, version: int) -> Any:
        return lambda current: current[1] == run and current[2] < version

    async def go() -> Any:
        release = asyncio.Event()

        async def in_flight() -> None:
            async with gate.calling(("e", "a", 0), lambda: loads.append("a0"),
                                    follows=same_run_older("a", 0)):
                loads.append("generating")
                await release.wait()
                loads.append("generated")

        async with gate.hold(("e", "a", 0), lambda: loads.append("hold a0")):
            first = asyncio.create_task(in_flight())
            while "generating" not in loads:
                await asyncio.sleep(0)
            second = asyncio.create_task(_enter(gate.calling(
                ("e", "a", 1), lambda: loads.append("a1"), follows=same_run_older("a", 1))))
            await asyncio.sleep(0)
            release.set()
            await asyncio.gather(first, second)
            # Another run's weights are never taken up mid-episode.
            await _enter(gate.calling(("e", "b", 5), lambda: loads.append("b5"),
                                      follows=same_run_older("b", 5)))
        return gate.current

    assert asyncio.run(go()) == ("e", "a", 1)
    assert loads == ["hold a0", "generating", "generated", "a1"]


async def _enter(manager: Any) -> None:
    async with manager:
        pass
