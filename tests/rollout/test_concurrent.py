"""The asyncio agent loop with many episodes in flight, on the real tiny model.

- concurrent episodes share one transformers engine, whose scheduler batches their requests,
  and record exactly what the same episodes record one at a time (greedy decoding);
- a tool that hangs is cut at the runner's deadline and recorded as a ``TimeoutError``
  outcome while the other episodes go on; async tools are awaited on the loop;
- an engine that dies fails the episodes in flight as ``error`` with the reason;
- the weights gate lets in-flight episodes finish on their weights and never starves a new
  policy; concurrency settings out of range are refused naming the setting;
- the bound on episodes in flight is not held while an episode's last events are stored.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from store.settings import Settings
from tests.rollout.turns import tool_call, turn
from workers.engines.backend import GenerationRequest, GenerationResult, SamplingParams
from workers.engines.backend_replay import ReplayBackend
from workers.engines.backend_transformers import TransformersBackend
from workers.engines.batching import BatchScheduler, EngineStopped
from workers.rollout.agent_tasks import Task, arithmetic_tasks
from workers.rollout.calculator import Calculator
from workers.rollout.loop import arun_episode, run_episode
from workers.rollout.runtime import RolloutRuntime, WeightsGate
from workers.rollout.sink import ListSink
from workers.rollout.tool_runner import ToolRunner
from workers.rollout.tools import ToolOutcome, ToolRegistry, function_schema

GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def batching(tiny_model_dir: Path) -> TransformersBackend:
    """A backend of its own: these tests look at its scheduler's counters."""
    backend = TransformersBackend(tiny_model_dir, max_batch=16)
    yield backend
    backend.close()


def _calls(sink: ListSink, episode_id: str) -> list[Any]:
    return [e for e in sink.events(episode_id) if e.type == "llm_called"]


def test_concurrent_episodes_share_one_engine_and_record_as_sequential(
        batching: TransformersBackend, registry: ToolRegistry) -> None:
    tasks = arithmetic_tasks(12, seed=5)
    alone = ListSink()
    for index, task in enumerate(tasks):
        run_episode(task=task, backend=batching, tools=registry, sink=alone, run_id="r",
                    episode_id=f"e{index}", sampling=GREEDY, max_turns=2)
    before = batching.scheduler().batches
    together = ListSink()

    async def play_all() -> list[Any]:
        return await asyncio.gather(*(
            arun_episode(task=task, backend=batching, tools=registry, sink=together,
                         run_id="r", episode_id=f"e{index}", sampling=GREEDY, max_turns=2)
            for index, task in enumerate(tasks)))

    results = asyncio.run(play_all())
    calls = sum(r.llm_calls for r in results)
    batches = batching.scheduler().batches - before
    assert batching.scheduler().largest_batch > 1
    assert batches < calls, f"{calls} calls took {batches} batches: nothing was batched"
    for index in range(len(tasks)):
        episode = f"e{index}"
        assert together.types(episode) == alone.types(episode)
        for mine, theirs in zip(_calls(together, episode), _calls(alone, episode), strict=True):
            np.testing.assert_array_equal(mine.prompt_ids, theirs.prompt_ids)
            np.testing.assert_array_equal(mine.response_ids, theirs.response_ids)
            np.testing.assert_allclose(mine.logprobs, theirs.logprobs, atol=1e-4)
            assert mine.finish_reason == theirs.finish_reason


def test_seeded_sampling_does_not_depend_on_the_batch(
        batching: TransformersBackend, registry: ToolRegistry) -> None:
    """Sampled (not greedy) episodes with seeds: played one by one or concurrently in padded
    batches, each call draws the same tokens (its row is sampled with its own seed), so a
    worker's concurrency does not change what a seeded run generates."""
    tasks = arithmetic_tasks(8, seed=9)

    def sampling(index: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=1000 + index)

    alone = ListSink()
    for index, task in enumerate(tasks):
        run_episode(task=task, backend=batching, tools=registry, sink=alone, run_id="r",
                    episode_id=f"s{index}", sampling=sampling(index), max_turns=2)
    largest = batching.scheduler().largest_batch
    together = ListSink()

    async def play_all() -> list[Any]:
        return await asyncio.gather(*(
            arun_episode(task=task, backend=batching, tools=registry, sink=together,
                         run_id="r", episode_id=f"s{index}", sampling=sampling(index),
                         max_turns=2)
            for index, task in enumerate(tasks)))

    asyncio.run(play_all())
    assert batching.scheduler().largest_batch > 1 or largest > 1
    differing = 0
    for index in range(len(tasks)):
        for mine, theirs in zip(_calls(together, f"s{index}"), _calls(alone, f"s{index}"),
                                strict=False):
            np.testing.assert_array_equal(mine.prompt_ids, theirs.prompt_ids)
            np.testing.assert_array_equal(mine.response_ids, theirs.response_ids)
            np.testing.assert_allclose(mine.logprobs, theirs.logprobs, atol=1e-4)
        differing += not np.array_equal(_calls(alone, f"s{index}")[0].response_ids,
                                        _calls(alone, "s0")[0].response_ids)
    assert differing >= len(tasks) // 2  # the seeds differ, and so do the draws


def test_padded_batch_keeps_each_request_s_own_limits(batching: TransformersBackend) -> None:
    tasks = arithmetic_tasks(3, seed=1)
    requests = [GenerationRequest(sampling=SamplingParams(temperature=0, max_tokens=4 + 6 * i),
                                  messages=task.messages) for i, task in enumerate(tasks)]
    for single, batched in zip([batching.generate(r) for r in requests],
                               batching.generate_batch(requests), strict=True):
        np.testing.assert_array_equal(single.response_ids, batched.response_ids)
        assert single.finish_reason == batched.finish_reason
    mixed = [requests[0], GenerationRequest(sampling=SamplingParams(temperature=0.5),
                                            messages=tasks[1].messages)]
    with pytest.raises(ValueError, match="share temperature and top_p"):
        batching.generate_batch(mixed)


class Sleeper:
    """A synchronous tool that hangs for ``seconds``."""

    name = "sleep"
    schema = function_schema("sleep", description="Sleep.", properties={})

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, arguments: dict[str, Any]) -> ToolOutcome:
        time.sleep(self.seconds)
        return ToolOutcome(output="slept")


class Lookup:
    """An async tool: awaited on the event loop, not run in a thread."""

    name = "lookup"
    schema = function_schema("lookup", description="Look a key up.",
                             properties={"key": {"type": "string"}}, required=["key"])

    def __init__(self) -> None:
        self.loops: list[asyncio.AbstractEventLoop] = []

    def __call__(self, arguments: dict[str, Any]) -> ToolOutcome:
        raise AssertionError("an async tool must be awaited, not called")

    async def acall(self, arguments: dict[str, Any]) -> ToolOutcome:
        self.loops.append(asyncio.get_running_loop())
        await asyncio.sleep(0.01)
        return ToolOutcome(output=f"value of {arguments['key']}")


def test_a_burst_of_requests_to_an_idle_engine_runs_as_one_batch(
        batching: TransformersBackend) -> None:
    # Episodes started together submit one by one, a few milliseconds apart; every submit
    # wakes the scheduler, which must go on gathering while they keep coming instead of
    # running the first one or two and keeping the rest waiting a whole batch.
    scheduler = BatchScheduler(batching.generate_batch, key=lambda r: 0, max_batch=16,
                               gather_s=0.05)
    requests = [GenerationRequest(sampling=SamplingParams(temperature=0, max_tokens=4),
                                  messages=task.messages)
                for task in arithmetic_tasks(12, seed=3)]

    async def one(index: int) -> GenerationResult:
        await asyncio.sleep(0.005 * index)  # each rendered its prompt, say, 5 ms after the last
        return await scheduler.submit(requests[index])

    async def burst() -> list[GenerationResult]:
        return await asyncio.gather(*(one(i) for i in range(len(requests))))

    try:
        results = asyncio.run(burst())
        assert (scheduler.batches, scheduler.largest_batch) == (1, 12)
        assert all(r.response_ids.shape[0] >= 1 for r in results)
        # A second burst to the idle engine: one batch again.
        asyncio.run(burst())
        assert (scheduler.batches, scheduler.largest_batch) == (2, 12)
    finally:
        scheduler.close()


def test_hanging_tool_is_cut_at_its_deadline_while_others_go_on(
        hf_backend: TransformersBackend) -> None:
    lookup = Lookup()
    registry = ToolRegistry([Sleeper(5.0), lookup, Calculator()])
    runner = ToolRunner(workers=2, timeout_s=0.5)
    hanging = Task(task_id="hang", messages=({"role": "user", "content": "wait"},),
                   tools=(Sleeper.schema,), ground_truth="1", reward="final_answer")
    quick = Task(task_id="quick", messages=({"role": "user", "content": "look"},),
                 tools=(Lookup.schema,), ground_truth="1", reward="final_answer")
    sink = ListSink()
    finished: list[tuple[str, float]] = []

    async def play(task: Task, script: list[str], episode_id: str) -> None:
        await arun_episode(task=task, backend=ReplayBackend(hf_backend, script),
                           tools=registry, sink=sink, run_id="r", episode_id=episode_id,
                           sampling=SamplingParams(max_tokens=128), tool_runner=runner)
        finished.append((episode_id, time.monotonic()))

    async def both() -> None:
        await asyncio.gather(
            play(hanging, [turn("wait", tool_call("sleep")), "done"], "hang"),
            play(quick, [turn("look", tool_call("lookup", key="k")), "done"], "quick"))

    started = time.monotonic()
    asyncio.run(both())
    runner.close()
    assert time.monotonic() - started < 4.5, "the hanging tool was not cut at its deadline"
    slow = next(e for e in sink.events("hang") if e.type == "tool_returned")
    assert slow.is_error and slow.error_type == "TimeoutError"
    assert "within 0.5 s" in slow.output
    assert sink.types("hang")[-1] == "episode_finished"
    fast = next(e for e in sink.events("quick") if e.type == "tool_returned")
    assert fast.output == "value of k" and not fast.is_error
    assert len(lookup.loops) == 1
    assert [name for name, _ in finished] == ["quick", "hang"]


def test_tool_runner_refuses_bad_settings() -> None:
    with pytest.raises(ValueError, match="workers"):
        ToolRunner(workers=0)
    with pytest.raises(ValueError, match="timeout_s"):
        ToolRunner(timeout_s=float("inf"))


def test_engine_that_dies_fails_the_episodes_in_flight(registry: ToolRegistry) -> None:
    def broken(requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        raise RuntimeError("CUDA error: device lost")

    class DyingEngine:
        def __init__(self) -> None:
            self.scheduler = BatchScheduler(broken, key=lambda r: 0, max_batch=8)

        async def agenerate(self, request: GenerationRequest) -> GenerationResult:
            return await self.scheduler.submit(request)

    engine = DyingEngine()
    sink = ListSink()

    async def play_all() -> list[Any]:
        return await asyncio.gather(*(
            arun_episode(task=task, backend=engine, tools=registry, sink=sink, run_id="r",
                         episode_id=f"e{i}")
            for i, task in enumerate(arithmetic_tasks(4, seed=0))))

    results = asyncio.run(play_all())
    assert [r.status for r in results] == ["error"] * 4
    assert all("device lost" in (r.reason or "") for r in results)
    for i in range(4):
        assert sink.types(f"e{i}") == ["episode_started", "reward_assigned",
                                       "episode_finished"]
        assert sink.events(f"e{i}")[-1].reason == "RuntimeError: CUDA error: device lost"
    engine.scheduler.close("the engine was shut down")
    later = asyncio.run(arun_episode(task=arithmetic_tasks(1, seed=0)[0], backend=engine,
                                     tools=registry, sink=sink, run_id="r", episode_id="late"))
    assert later.status == "error" and "EngineStopped" in (later.reason or "")
    with pytest.raises(EngineStopped):
        asyncio.run(engine.agenerate(GenerationRequest(sampling=SamplingParams(),
                                                       prompt_ids=(1,))))


def test_weights_gate_lets_episodes_finish_and_never_starves_a_new_policy() -> None:
    runtime = RolloutRuntime(concurrency=4)
    loads: list[str] = []
    timeline: list[str] = []

    async def group(name: str, target: str, delay: float, hold: float) -> None:
        await asyncio.sleep(delay)
        async with runtime.weights.hold(target, lambda: loads.append(target)):
            timeline.append(f"{name} starts on {target}")
            await asyncio.sleep(hold)
            timeline.append(f"{name} ends")

    async def scenario() -> None:
        await asyncio.gather(group("a", "v0", 0.0, 0.3),
                             group("b", "v1", 0.05, 0.05),
                             group("c", "v0", 0.1, 0.05))

    try:
        runtime.call(scenario)
    finally:
        runtime.close()
    assert loads == ["v0", "v1", "v0"]
    assert timeline == ["a starts on v0", "a ends", "b starts on v1", "b ends",
                        "c starts on v0", "c ends"]
    assert isinstance(runtime.weights, WeightsGate)


def test_concurrency_settings_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match="rollout_concurrency"):
        Settings(rollout_concurrency=0)
    with pytest.raises(ValueError, match="rollout_groups"):
        Settings(rollout_groups=5000)
    with pytest.raises(ValueError, match="rollout_concurrency"):
        RolloutRuntime(concurrency=0)
    env = {**os.environ, "TRAJSTORE_ROLLOUT_CONCURRENCY": "0"}
    done = subprocess.run([sys.executable, "-m", "trajstore", "worker", "--queues", "rollout"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "TRAJSTORE_ROLLOUT_CONCURRENCY" in done.stdout + done.stderr


class _HeldSink(ListSink):
    """Holds the append of every ``episode_finished`` until an episode named in ``waits_for``
    has appended something: the store taking its time to commit an episode's end."""

    def __init__(self, waits_for: str) -> None:
        super().__init__()
        self.waits_for = waits_for
        self.order: list[str] = []
        self.other_started = asyncio.Event()

    async def aappend(self, stream_id: str, events: Sequence[Any]) -> int:
        if stream_id == self.waits_for:
            self.other_started.set()
        if events[-1].type == "episode_finished" and stream_id != self.waits_for:
            self.order.append(f"{stream_id} end held")
            await self.other_started.wait()
        self.order.append(f"{stream_id} {events[-1].type}")
        return self.append(stream_id, events)


def test_the_episode_bound_is_released_before_the_last_events_are_stored(
        batching: TransformersBackend, registry: ToolRegistry) -> None:
    sink = _HeldSink(waits_for="second")
    tasks = arithmetic_tasks(2, seed=8)

    async def play() -> list[Any]:
        gate = asyncio.Semaphore(1)  # one episode generating at a time
        return await asyncio.wait_for(asyncio.gather(*(
            arun_episode(task=task, backend=batching, tools=registry, sink=sink, run_id="r",
                         episode_id=name, sampling=GREEDY, max_turns=1, gate=gate)
            for name, task in zip(("first", "second"), tasks, strict=True))), timeout=120)

    # Were the gate held until "first" is stored, "second" could never start: a timeout.
    first, second = asyncio.run(play())
    assert first.episode_id == "first" and second.episode_id == "second"
    assert sink.order.index("first end held") < sink.order.index("first episode_finished")
    assert sink.types("first")[-1] == sink.types("second")[-1] == "episode_finished"
    with pytest.raises(TypeError, match="gate must be an asyncio.Semaphore"):
        asyncio.run(arun_episode(task=tasks[0], backend=batching, tools=registry,
                                 sink=ListSink(), run_id="r", gate=1))  # type: ignore[arg-type]
