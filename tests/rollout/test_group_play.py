"""Groups of episodes on the real store with the tiny model: deterministic ids, no doubling on
a second delivery, abandoned episodes replaced, the policy version, weights from checkpoints,
task ids, and the episode writer's idempotent, versioned appends."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from store.errors import ConflictError
from store.eventlog import NO_STREAM, EventStore, run_stream_id
from store.events import Event, PolicyUpdated, RollbackConfig, RunConfig, RunCreated
from workers.engines.backend import GenerationRequest, SamplingParams
from workers.engines.backend_transformers import TransformersBackend
from workers.rollout.agent_tasks import (
    MAX_BUILTIN_INDEX,
    arithmetic_tasks,
    builtin_task,
    function_call_tasks,
    resolve_task,
)
from workers.rollout.episode_writer import EpisodeWriter, deterministic_event_id
from workers.rollout.group import (
    episode_id_for,
    episode_seed,
    group_id_for,
    play_group,
)
from workers.rollout.group_log import PolicyState, StoreGroupLog
from workers.rollout.tools import ToolRegistry
from workers.rollout.worker_engine import RolloutEngine, base_model_dir

SAMPLING = SamplingParams(temperature=1.0, max_tokens=24)
TASK = arithmetic_tasks(1, seed=5)[0]


def new_run(store: EventStore, **config: Any) -> str:
    run_id = f"run-{uuid.uuid4().hex[:10]}"
    store.append(run_stream_id(run_id), [RunCreated(run_id=run_id,
                                                    config=RunConfig(**config))], NO_STREAM)
    return run_id


def play(store: EventStore, backend: Any, registry: ToolRegistry, run_id: str, *,
         version: int = 0, log: Any = None, index: int = 0) -> Any:
    """Play the group: as many episodes as the run's group_size."""
    return play_group(log=log or StoreGroupLog(store), run_id=run_id, task=TASK,
                      backend=backend, tools=registry, policy_version=version,
                      group_index=index, sampling=SAMPLING, max_turns=2)


def test_group_plays_n_episodes_once(store: EventStore, hf_backend: TransformersBackend,
                                     registry: ToolRegistry) -> None:
    run_id = new_run(store, group_size=3)
    result = play(store, hf_backend, registry, run_id)
    group_id = group_id_for(run_id, TASK.task_id, 0, 0)
    assert result.group_id == group_id and result.played == 3
    assert [s.episode_id for s in result.slots] == [episode_id_for(group_id, k)
                                                    for k in range(3)]
    episodes = store.list_episodes(run_id)
    assert sorted(e.episode_id for e in episodes) == sorted(s.episode_id for s in result.slots)
    seeds = set()
    for slot in result.slots:
        events = store.get_episode(slot.episode_id)
        assert [e.type for e in events[-2:]] == ["reward_assigned", "episode_finished"]
        started = events[0].event
        assert started.group_id == group_id and started.policy_version == 0
        assert started.sampling_params["seed"] == episode_seed(slot.episode_id)
        seeds.add(started.sampling_params["seed"])
        assert events[-1].event.status == slot.status
        assert [e.event.event_id for e in events] == [
            deterministic_event_id(_namespace(group_id), slot.episode_id, v)
            for v in range(1, len(events) + 1)]
    assert len(seeds) == 3

    again = play(store, hf_backend, registry, run_id)
    assert again.played == 0
    assert [(s.episode_id, s.status, s.reward) for s in again.slots] == [
        (s.episode_id, s.status, s.reward) for s in result.slots]
    assert len(store.list_episodes(run_id)) == 3

    other = play(store, hf_backend, registry, run_id, index=1)
    assert other.group_id != group_id and len(store.list_episodes(run_id)) == 6


def _namespace(group_id: str) -> uuid.UUID:
    from workers.rollout import group

    return uuid.uuid5(group._NAMESPACE, group_id)


class CrashingLog(StoreGroupLog):
    """The store, but the process "dies" (raises) at the append that would reach
    ``stop_at`` appends in total: what a SIGKILLed worker leaves behind."""

    def __init__(self, store: EventStore, stop_at: int) -> None:
        super().__init__(store)
        self.appends = 0
        self.stop_at = stop_at

    def append(self, stream_id: str, events: Sequence[Event], expected_version: Any = "any"
               ) -> Any:
        self.appends += 1
        if self.appends >= self.stop_at:
            raise KeyboardInterrupt("worker killed")
        return super().append(stream_id, events, expected_version)

    async def aappend(self, stream_id: str, events: Sequence[Event],
                      expected_version: Any = "any") -> Any:
        self.appends += 1
        if self.appends >= self.stop_at:
            raise KeyboardInterrupt("worker killed")
        return await super().aappend(stream_id, events, expected_version)


def test_abandoned_episode_is_resumed(
        store: EventStore, hf_backend: TransformersBackend, registry: ToolRegistry) -> None:
    """The worker dies at its 3rd append: the next play resumes each unfinished episode
    where its log ends (same episode, nothing stored appended again) and the group ends as
    an uninterrupted one with the same sampling seed does, token for token."""
    from store.events import LLMCalled, RolloutConfig

    def tokens_and_rewards(run_id: str, result: Any) -> list[tuple[list[list[int]], Any]]:
        return [([e.event.response_ids.tolist() for e in store.get_episode(s.episode_id)
                  if isinstance(e.event, LLMCalled)], s.reward) for s in result.slots]

    rollout = RolloutConfig(seed=3, max_tokens=24)
    reference_run = new_run(store, group_size=2, rollout=rollout)
    reference = play(store, hf_backend, registry, reference_run)
    run_id = new_run(store, group_size=2, rollout=rollout)
    crashing = CrashingLog(store, stop_at=3)
    with pytest.raises(KeyboardInterrupt):
        play(store, hf_backend, registry, run_id, log=crashing)
    group_id = group_id_for(run_id, TASK.task_id, 0, 0)
    before = {e.episode_id: e.status for e in store.list_episodes(run_id)}
    assert "running" in before.values()
    stored = {eid: [e.event.event_id for e in store.get_episode(eid)] for eid in before}

    result = play(store, hf_backend, registry, run_id)
    by_id = {e.episode_id: e for e in store.list_episodes(run_id)}
    abandoned = [eid for eid, status in before.items() if status == "running"]
    assert abandoned  # the slots play concurrently: one or both were cut off
    for dead in abandoned:
        slot = int(dead.rsplit("-", 1)[1])
        resumed = result.slots[slot]
        assert resumed.episode_id == dead == episode_id_for(group_id, slot)
        assert resumed.resumed and resumed.played and resumed.aborted == ()
        assert by_id[dead].status not in ("running", "aborted", "error")
        ids = [e.event.event_id for e in store.get_episode(dead)]
        assert ids[:len(stored[dead])] == stored[dead] and len(set(ids)) == len(ids)
    assert sorted(by_id) == sorted(episode_id_for(group_id, k) for k in range(2))
    assert tokens_and_rewards(run_id, result) == tokens_and_rewards(reference_run, reference)
    assert play(store, hf_backend, registry, run_id).played == 0


def test_a_live_writer_keeps_its_slot(store: EventStore, hf_backend: TransformersBackend,
                                      registry: ToolRegistry) -> None:
    run_id = new_run(store, group_size=1)
    group_id = group_id_for(run_id, TASK.task_id, 0, 0)
    first = episode_id_for(group_id, 0)
    crashing = CrashingLog(store, stop_at=2)
    with pytest.raises(KeyboardInterrupt):
        play(store, hf_backend, registry, run_id, log=crashing)
    version = store.stream_version(first)

    class RacingLog(StoreGroupLog):
        """A log where the first worker appends again just after its events were read for
        the resume: the resumed episode's first append conflicts."""

        def stream_events(self, stream_id: str) -> list[Event]:
            events = super().stream_events(stream_id)
            if stream_id == first and len(events) == version:
                store.append(first, [_tool_event()], version)
            return events

    result = play(store, hf_backend, registry, run_id, log=RacingLog(store))
    assert result.played == 0 and result.slots[0].status is None
    assert store.list_episodes(run_id)[0].status == "running"


def _tool_event() -> Event:
    from store.events import ToolReturned

    return ToolReturned(name="calculator", output="2")


def test_policy_version_names_the_group(store: EventStore, hf_backend: TransformersBackend,
                                        registry: ToolRegistry) -> None:
    run_id = new_run(store, group_size=1)
    log = StoreGroupLog(store)
    assert log.policy(run_id) == PolicyState(0, None)
    store.append(run_stream_id(run_id), [PolicyUpdated(version=1, step=1, checkpoint="/c1"),
                                         PolicyUpdated(version=2, step=2)])
    assert log.policy(run_id) == PolicyState(2, None)
    result = play(store, hf_backend, registry, run_id, version=2)
    assert result.group_id == group_id_for(run_id, TASK.task_id, 2, 0)
    assert result.group_id != group_id_for(run_id, TASK.task_id, 0, 0)
    started = store.get_episode(result.slots[0].episode_id)[0].event
    assert started.policy_version == 2
    assert log.run_config(run_id) == RunConfig(group_size=1)


def test_a_pinned_policy_version_is_that_version_s(store: EventStore) -> None:
    """``policy(run, version)`` gives that version's checkpoint even after newer ones (a
    group pinned to the policy its batch was sent for), and refuses a version the run has
    not reached."""
    run_id = new_run(store, group_size=1)
    log = StoreGroupLog(store)
    assert log.policy(run_id, 0) == PolicyState(0, None)
    store.append(run_stream_id(run_id), [PolicyUpdated(version=1, step=1, checkpoint="/c1"),
                                         PolicyUpdated(version=2, step=2, checkpoint="/c2")])
    assert log.policy(run_id, 1) == PolicyState(1, "/c1")
    assert log.policy(run_id) == log.policy(run_id, 2) == PolicyState(2, "/c2")
    with pytest.raises(ValueError, match="has no policy version 3 \\(newest: 2\\)"):
        log.policy(run_id, 3)


def test_the_run_seed_makes_two_runs_sample_alike(store: EventStore,
                                                  hf_backend: TransformersBackend,
                                                  registry: ToolRegistry) -> None:
    """With ``RunConfig.rollout.seed``, a group's episodes sample from that seed and their
    place in the run, not from the run id: two runs with one seed draw the same tokens, a
    third with another seed does not."""
    from store.events import RolloutConfig

    def tokens(seed: int) -> list[list[int]]:
        run_id = new_run(store, group_size=2, rollout=RolloutConfig(seed=seed, max_tokens=24))
        result = play_group(log=StoreGroupLog(store), run_id=run_id, task=TASK,
                            backend=hf_backend, tools=registry, policy_version=0)
        return [next(e.event.response_ids.tolist() for e in store.get_episode(s.episode_id)
                     if e.event.type == "llm_called") for s in result.slots]

    first, again, other = tokens(7), tokens(7), tokens(8)
    assert first == again and first[0] != first[1]
    assert other != first


def test_rollback_config_of_the_run_is_used(store: EventStore,
                                            hf_backend: TransformersBackend,
                                            registry: ToolRegistry) -> None:
    run_id = new_run(store, rollback=RollbackConfig(max_tool_retries=0))
    config = StoreGroupLog(store).run_config(run_id)
    assert config.rollback.max_tool_retries == 0


def test_bad_arguments(store: EventStore, hf_backend: TransformersBackend,
                       registry: ToolRegistry) -> None:
    run_id = new_run(store, group_size=1)
    for name, value in (("group_index", -1), ("policy_version", -2)):
        kwargs = {"group_index": 0, "policy_version": 0, name: value}
        with pytest.raises(ValueError, match=name):
            play_group(log=StoreGroupLog(store), run_id=run_id, task=TASK,
                       backend=hf_backend, tools=registry, **kwargs)
    with pytest.raises(TypeError, match="task"):
        play_group(log=StoreGroupLog(store), run_id=run_id, task="arith-0-0",  # type: ignore
                   backend=hf_backend, tools=registry, policy_version=0)
    with pytest.raises(TypeError, match="EventStore"):
        StoreGroupLog("postgres://")  # type: ignore[arg-type]


def test_engine_loads_checkpoints_and_returns_to_the_base(tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    backend = TransformersBackend(tiny_model_dir)
    engine = RolloutEngine(backend, kind="transformers", model_dir=tiny_model_dir)
    request = GenerationRequest(sampling=SamplingParams(temperature=0.0, max_tokens=6),
                                messages=({"role": "user", "content": "2 + 2?"},))
    base = backend.generate(request)
    engine.ensure("run-a", PolicyState(0))
    assert engine.loads == 0 and engine.loaded == ("run-a", 0)

    checkpoint = tmp_path / "v000001"
    checkpoint.mkdir()
    state = {name: (tensor * 3 if "proj" in name else tensor).contiguous()
             for name, tensor in backend.model.state_dict().items()}
    save_file(state, str(checkpoint / "model.safetensors"))
    engine.ensure("run-a", PolicyState(1, str(checkpoint)))
    trained = backend.generate(request)
    assert trained.policy_version == 1 and engine.loads == 1
    assert not torch.allclose(torch.from_numpy(base.logprobs), torch.from_numpy(
        trained.logprobs)) or base.response_ids.tolist() != trained.response_ids.tolist()

    engine.ensure("run-a", PolicyState(1, str(checkpoint)))
    assert engine.loads == 1
    engine.ensure("run-b", PolicyState(0))
    again = backend.generate(request)
    assert engine.loads == 2 and again.policy_version == 0
    assert again.response_ids.tolist() == base.response_ids.tolist()
    assert torch.allclose(torch.from_numpy(again.logprobs), torch.from_numpy(base.logprobs))

    engine.ensure("run-c", PolicyState(4))
    assert backend.policy_version == 4 and engine.loads == 2
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        engine.ensure("run-c", PolicyState(5, str(tmp_path / "gone")))


def test_base_model_dir(tiny_model_dir: Path, tmp_path: Path) -> None:
    from store.settings import Settings

    settings = Settings(data_dir=tmp_path)
    assert base_model_dir(RunConfig(model=str(tiny_model_dir)), settings=settings) == \
        tiny_model_dir
    with pytest.raises(ValueError, match="'model'"):
        base_model_dir(RunConfig(model="Qwen/Qwen3-8B"), settings=settings)


def test_builtin_task_ids_are_stable(tmp_path: Path) -> None:
    assert builtin_task("arith-3-7") == arithmetic_tasks(20, seed=3)[7]
    assert builtin_task("fc-1-4") == function_call_tasks(5, seed=1)[4]
    assert builtin_task("arith-3-7").task_id == "arith-3-7"
    assert builtin_task("weather-1") is None
    with pytest.raises(ValueError, match="index"):
        builtin_task(f"fc-0-{MAX_BUILTIN_INDEX + 1}")
    tasks_dir = tmp_path / "tasks"
    tasks_dir.mkdir()
    (tasks_dir / "mine.jsonl").write_text(json.dumps({
        "task_id": "weather-1", "messages": [{"role": "user", "content": "Oslo?"}],
        "ground_truth": "3", "reward": "final_answer"}) + "\n")
    assert resolve_task("weather-1", tasks_dir=tasks_dir).messages[0]["content"] == "Oslo?"
    assert resolve_task("arith-0-0", tasks_dir=tasks_dir).task_id == "arith-0-0"
    with pytest.raises(ValueError, match="unknown task_id 'nope'"):
        resolve_task("nope", tasks_dir=tasks_dir)
    with pytest.raises(ValueError, match="task_id"):
        resolve_task("", tasks_dir=tasks_dir)


def test_episode_writer_retries_and_conflicts(store: EventStore) -> None:
    namespace = uuid.uuid4()
    stream = f"ep-{uuid.uuid4().hex}"
    writer = EpisodeWriter(StoreGroupLog(store), namespace=namespace)
    tool = _tool_event()
    first = writer.append(stream, [tool, tool])
    assert first.version == 2 and not first.duplicate
    # The same batch again from a writer that lost the answer: stored once.
    retry = EpisodeWriter(StoreGroupLog(store), namespace=namespace).append(stream,
                                                                            [tool, tool])
    assert retry.duplicate and retry.positions == first.positions
    assert [r.event.event_id for r in store.read_stream(stream)] == [
        deterministic_event_id(namespace, stream, 1), deterministic_event_id(namespace,
                                                                             stream, 2)]
    # A second writer with other ids on a started stream conflicts.
    with pytest.raises(ConflictError):
        EpisodeWriter(StoreGroupLog(store), namespace=uuid.uuid4()).append(stream, [tool])
    assert writer.append(stream, [tool]).version == 3
    with pytest.raises(ValueError, match="empty"):
        writer.append(stream, [])
    with pytest.raises(ValueError, match="version"):
        deterministic_event_id(namespace, stream, 0)
    with pytest.raises(TypeError, match="append"):
        EpisodeWriter(object(), namespace=namespace)  # type: ignore[arg-type]
