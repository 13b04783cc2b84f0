"""Branching from a stored turn, on the real store with the tiny model: a parent episode is
played by the loop (scripted turns forced through the model: a calculator call, a malformed
call that is rolled back, its retry, the answer); branches from its turns and checkpoints
keep its recorded calls token for token (nothing generated or run again), generate new
continuations with the model, record the parent, and replay into samples. Missing turns,
checkpoints and episodes, and sizes out of range, are refused naming them."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from store import queries
from store.errors import NotFoundError
from store.eventlog import NO_STREAM, EventStore, run_stream_id
from store.events import Event, LLMCalled, RunConfig, RunCreated, ToolReturned
from tests.rollout.turns import tool_call, turn
from workers.engines.backend import SamplingParams
from workers.engines.backend_replay import ReplayBackend
from workers.engines.backend_transformers import TransformersBackend
from workers.replay.jobs.project import project_episode
from workers.rollout.agent_tasks import builtin_task
from workers.rollout.branch import play_branch
from workers.rollout.branch_point import BranchNotFound, branch_group_id
from workers.rollout.group import play_group
from workers.rollout.group_log import StoreGroupLog
from workers.rollout.tool_runner import ToolRunner
from workers.rollout.tools import ToolOutcome, ToolRegistry

TASK = builtin_task("arith-0-0")
assert TASK is not None
EXPRESSION = TASK.messages[-1]["content"].removeprefix("What is ").removesuffix("?")
CALL = turn("compute it", tool_call("calculator", expression=EXPRESSION))
MALFORMED = "<think>\nagain\n</think>\n\n<tool_call>\n{broken\n</tool_call>"
ANSWER = f"The answer is {TASK.ground_truth}."
SCRIPT = [CALL, MALFORMED, CALL, ANSWER]


class CountingRunner(ToolRunner):
    """A tool runner that records every call it runs."""

    def __init__(self) -> None:
        super().__init__(workers=2, timeout_s=30.0)
        self.calls: list[tuple[str, dict[str, Any]]] = []

    async def call(self, registry: ToolRegistry, name: str, arguments: Any) -> ToolOutcome:
        self.calls.append((name, dict(arguments)))
        return await super().call(registry, name, arguments)


def parent_episode(store: EventStore, backend: TransformersBackend, registry: ToolRegistry,
                   tiny_model_dir: Path, *, group_size: int = 2) -> tuple[str, str]:
    """A run and its one played episode: call 1 (calculator), call 2 (malformed: rolled
    back), call 3 (its retry), call 4 (the answer)."""
    run_id = f"run-{uuid.uuid4().hex[:10]}"
    config = RunConfig(group_size=group_size, tokenizer=str(tiny_model_dir))
    store.append(run_stream_id(run_id), [RunCreated(run_id=run_id, config=config)], NO_STREAM)
    result = play_group(log=StoreGroupLog(store), run_id=run_id, task=TASK,
                        backend=ReplayBackend(backend, SCRIPT), tools=registry,
                        policy_version=0, run_config=config.model_copy(update={"group_size": 1}),
                        sampling=SamplingParams(temperature=1.0, max_tokens=256), max_turns=4)
    episode = result.slots[0].episode_id
    assert result.slots[0].status == "completed"
    assert [e.type for e in events_of(store, episode)].count("rolled_back") == 1
    return run_id, episode


def events_of(store: EventStore, episode_id: str) -> list[Event]:
    return [r.event for r in store.get_episode(episode_id)]


def calls_of(events: list[Event]) -> list[LLMCalled]:
    return [e for e in events if isinstance(e, LLMCalled)]


def tokens(call: LLMCalled) -> tuple[list[int], list[int], list[float]]:
    return call.prompt_ids.tolist(), call.response_ids.tolist(), call.logprobs.tolist()


def test_branch_from_a_turn_keeps_the_prefix_and_generates_the_rest(
        store: EventStore, hf_backend: TransformersBackend, registry: ToolRegistry,
        tiny_model_dir: Path) -> None:
    run_id, parent = parent_episode(store, hf_backend, registry, tiny_model_dir)
    parent_events = events_of(store, parent)
    parent_calls = calls_of(parent_events)
    runner = CountingRunner()
    result = play_branch(log=StoreGroupLog(store), episode_id=parent, backend=hf_backend,
                         tools=registry, turn=1, n=3, tool_runner=runner,
                         sampling=SamplingParams(temperature=1.0, max_tokens=24))
    assert result.group_id == branch_group_id(parent, 1) and result.run_id == run_id
    assert len(result.slots) == 3 and result.played == 3
    assert all(slot.status is not None and slot.status != "error" for slot in result.slots)
    # The parent's calculator call was not run again (only new calls, if any, were run).
    assert ("calculator", {"expression": EXPRESSION}) not in runner.calls

    responses = set()
    for slot in result.slots:
        events = events_of(store, slot.episode_id)
        started = events[0]
        assert started.type == "episode_started"
        assert started.run_id == run_id and started.group_id == result.group_id
        assert started.branched_from is not None
        assert started.branched_from.model_dump() == {"episode_id": parent, "turn": 1,
                                                      "checkpoint": None}
        assert started.messages == parent_events[0].messages
        calls = calls_of(events)
        assert len(calls) >= 2
        # The first turn is the parent's, token for token; its tool result is the recorded one.
        assert tokens(calls[0]) == tokens(parent_calls[0])
        assert calls[0].response == parent_calls[0].response
        assert calls[0].policy_version == parent_calls[0].policy_version
        results = [e for e in events if isinstance(e, ToolReturned)]
        parent_result = next(e for e in parent_events if isinstance(e, ToolReturned))
        assert results[0].output == parent_result.output == TASK.ground_truth
        # The next call sees the same prompt as the parent's second call, and is generated.
        assert calls[1].prompt_ids.tolist() == parent_calls[1].prompt_ids.tolist()
        assert calls[1].response_ids.tolist() != parent_calls[1].response_ids.tolist()
        responses.add(tuple(calls[1].response_ids.tolist()))
        assert [e.type for e in events[-2:]] == ["reward_assigned", "episode_finished"]
        # It replays into samples like any episode: the kept call trains as recorded.
        assert project_episode(store, slot.episode_id).outcome == "written"
        with store.db.connection() as conn:
            samples = conn.execute("SELECT count(*) FROM samples WHERE episode_id = %s",
                                   (slot.episode_id,)).fetchone()[0]
        assert samples >= 1
    assert len(responses) == 3, "each branch samples with its own seed"

    # The parent is queryable from its branches.
    rows = queries.list_episodes(store, queries.EpisodeFilters(run_ids=[run_id],
                                                               branched_from=parent))
    assert sorted(r["episode_id"] for r in rows) == sorted(s.episode_id for s in result.slots)
    assert all(r["branched_from"] == {"episode_id": parent, "turn": 1, "checkpoint": None}
               for r in rows)
    assert queries.episode_row(store, parent)["branched_from"] is None

    # Asking again finds the branch played: nothing is doubled.
    again = play_branch(log=StoreGroupLog(store), episode_id=parent, backend=hf_backend,
                        tools=registry, turn=1, n=3)
    assert again.played == 0 and [s.episode_id for s in again.slots] == [
        s.episode_id for s in result.slots]


def test_branch_after_a_failed_call_and_from_checkpoints(
        store: EventStore, hf_backend: TransformersBackend, registry: ToolRegistry,
        tiny_model_dir: Path) -> None:
    _, parent = parent_episode(store, hf_backend, registry, tiny_model_dir)
    parent_events = events_of(store, parent)
    parent_calls = calls_of(parent_events)
    log = StoreGroupLog(store)
    # Turn 2 keeps the malformed call: the branch rolls it back as the parent did, with a
    # regeneration of its own. Played with the parent's recorded sampling (n = group size).
    result = play_branch(log=log, episode_id=parent, backend=hf_backend, tools=registry,
                         turn=2)
    assert len(result.slots) == 2
    for slot in result.slots:
        events = events_of(store, slot.episode_id)
        types = [e.type for e in events]
        assert types[:9] == ["episode_started", "llm_called", "checkpoint_created",
                             "tool_returned", "llm_called", "checkpoint_created",
                             "tool_returned", "attempt_failed", "llm_called"]
        assert types[9] == "rolled_back"
        calls = calls_of(events)
        assert [tokens(c) for c in calls[:2]] == [tokens(c) for c in parent_calls[:2]]
        assert calls[2].prompt_ids.tolist() == parent_calls[2].prompt_ids.tolist()
        assert events[0].branched_from.turn == 2

    # A checkpoint stands for the context before the turn it guards: ckpt_2_0 guards call 2,
    # so the branch keeps call 1 only; ckpt_2_1 guards the retry (call 3), keeping calls 1-2.
    for checkpoint, kept in (("ckpt_2_0", 1), ("ckpt_2_1", 2)):
        branch = play_branch(log=log, episode_id=parent, backend=hf_backend, tools=registry,
                             checkpoint=checkpoint, n=1,
                             sampling=SamplingParams(temperature=1.0, max_tokens=16))
        events = events_of(store, branch.slots[0].episode_id)
        assert events[0].branched_from.model_dump() == {"episode_id": parent, "turn": kept,
                                                        "checkpoint": checkpoint}
        calls = calls_of(events)
        assert [tokens(c) for c in calls[:kept]] == [tokens(c) for c in parent_calls[:kept]]
        assert calls[kept].response_ids.tolist() != parent_calls[kept].response_ids.tolist()


def test_branch_from_what_is_not_recorded_is_refused(
        store: EventStore, hf_backend: TransformersBackend, registry: ToolRegistry,
        tiny_model_dir: Path) -> None:
    run_id, parent = parent_episode(store, hf_backend, registry, tiny_model_dir)
    log = StoreGroupLog(store)

    def branch(**kwargs: Any) -> Any:
        return play_branch(log=log, backend=hf_backend, tools=registry, **kwargs)

    with pytest.raises(BranchNotFound, match=r"no turn 5: it recorded 4 LLM calls"):
        branch(episode_id=parent, turn=5)
    with pytest.raises(BranchNotFound, match="no checkpoint 'ckpt_9_0'"):
        branch(episode_id=parent, checkpoint="ckpt_9_0")
    with pytest.raises(NotFoundError, match="no episode 'no-such-episode'"):
        branch(episode_id="no-such-episode", turn=0)
    for n in (0, 257):
        with pytest.raises(ValueError, match="^n must be"):
            branch(episode_id=parent, turn=1, n=n)
    with pytest.raises(ValueError, match="turn must be"):
        branch(episode_id=parent, turn=-1)
    with pytest.raises(ValueError, match="exactly one of turn and checkpoint"):
        branch(episode_id=parent, turn=1, checkpoint="ckpt_1_0")
    # Nothing was started by the refusals: the run holds the parent only.
    assert [e.episode_id for e in store.list_episodes(run_id)] == [parent]
