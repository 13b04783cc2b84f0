"""Branching from a stored turn: a group of new episodes that share a stored episode's prefix
and generate new continuations (:mod:`workers.rollout.branch_point` says which prefix).

Each episode of the branch is played by the agent loop (:func:`~workers.rollout.loop.arun_episode`)
with the parent's task, tools and sampling (a seed of its own), and records the parent in its
``episode_started`` (``branched_from: {episode_id, turn, checkpoint}``). While the prefix
lasts, the loop's LLM calls are the parent's recorded ``llm_called`` (prompt ids, response
ids, logprobs and policy version copied, nothing generated) and its tool calls the parent's
recorded ``tool_returned`` outcomes (nothing run again); its checkpoints, failed attempts and
rollbacks follow from them by the loop's own rules, so a branch from turn k holds the parent's
first k calls and everything the parent recorded around them. After the prefix, calls go to
the engine and tools run.

The prefix must replay as recorded: the prompt the loop renders for a recorded call must be
the recorded one (its ids, or its messages when the engine renders), the recorded response
ids must decode to the recorded message, and each tool call must be the recorded one. When
it does not (the run's template or tokenizer changed, the log was written by another
client), the episode ends ``error`` with the reason, as any loop failure does (reward 0,
source "error"), and is never trained.

Groups are as in :mod:`workers.rollout.group`: deterministic ids, slots played concurrently,
a finished slot counted and not played again, a half-written one closed ``aborted`` and played
again as its next attempt. The trainer leases a group once ``group_size`` of its episodes are
finished and rewarded, so a branch of fewer than the run's ``group_size`` episodes is recorded
and replayed but never leased.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import uuid
from collections.abc import Sequence
from typing import Any

from store.arguments import whole_number
from store.errors import ConflictError, IdempotencyError
from store.events import Event, LLMCalled, RunConfig, ToolReturned
from workers.engines.backend import (
    AsyncGenerationBackend,
    GenerationBackend,
    GenerationRequest,
    GenerationResult,
    PromptRenderer,
    SamplingParams,
)
from workers.engines.prompt import RunPrompt, decode_response, run_prompt
from workers.engines.toolcall import parse_response
from workers.rollout.agent_tasks import Task, resolve_task
from workers.rollout.aio import generate_async, run_sync
from workers.rollout.branch_point import (
    BranchPoint,
    branch_group_id,
    branch_point,
    check_branch_size,
)
from workers.rollout.episode_writer import EpisodeWriter
from workers.rollout.group import (
    DEFAULT_GROUP_SAMPLING,
    MAX_ATTEMPTS,
    GroupResult,
    SlotOutcome,
    abort_episode,
    episode_id_for,
    episode_seed,
)
from workers.rollout.group_log import GroupLog
from workers.rollout.loop import FORMAT_ERROR_TOOL_NAME, arun_episode
from workers.rollout.tool_runner import ToolRunner, default_tool_runner
from workers.rollout.tools import ToolOutcome, ToolRegistry

__all__ = ["BranchError", "aplay_branch", "branch_task", "play_branch"]

_NAMESPACE = uuid.UUID("9a1e0c44-2b7d-4f3e-8c6a-51d0e7b2a9f3")


class BranchError(Exception):
    """The parent's prefix does not replay as recorded (module docstring): the branched
    episode ends ``error`` with this message."""


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


class _RecordedCalls:
    """The backend of a branched episode: the parent's recorded calls first, then ``inner``.
    One per episode (it consumes the recorded calls)."""

    def __init__(self, inner: GenerationBackend | AsyncGenerationBackend,
                 calls: Sequence[LLMCalled], tokenizer: Any, stop: Sequence[str]) -> None:
        self.inner = inner
        self.calls = collections.deque(calls)
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.policy_version = int(getattr(inner, "policy_version", 0))
        self.taken = 0

    def recorded(self, request: GenerationRequest) -> GenerationResult | None:
        """The next recorded call as a result (None once they are used up); BranchError when
        ``request`` is not the recorded request."""
        if not self.calls:
            return None
        call = self.calls.popleft()
        self.taken += 1
        where = f"recorded LLM call {self.taken} ({call.call_id})"
        if request.prompt_ids is not None:
            if [int(i) for i in request.prompt_ids] != [int(i) for i in call.prompt_ids]:
                raise BranchError(f"the prompt ids of {where} differ from the ones this run "
                                  f"renders now; the prefix cannot be replayed")
        elif _plain(list(request.messages or ())) != _plain(call.messages):
            raise BranchError(f"the request messages of {where} differ from the ones the "
                              f"loop builds; the prefix cannot be replayed")
        if self.tokenizer is None:
            raise BranchError("no tokenizer here decodes the recorded responses")
        ids = [int(i) for i in call.response_ids]
        text, _ = decode_response(self.tokenizer, ids, stop=self.stop)
        if _plain(parse_response(text, call_id=f"call_{self.taken}").to_message()) != _plain(
                call.response):
            raise BranchError(f"the response ids of {where} do not decode to its recorded "
                              f"message; the prefix cannot be replayed")
        return GenerationResult(
            prompt_ids=call.prompt_ids, response_ids=call.response_ids, logprobs=call.logprobs,
            text=text, finish_reason="length" if call.finish_reason == "length" else "stop",
            policy_version=call.policy_version)

    def generate(self, request: GenerationRequest) -> GenerationResult:
        result = self.recorded(request)
        if result is not None:
            return result
        if not isinstance(self.inner, GenerationBackend):
            raise TypeError(f"{type(self.inner).__name__} has no generate")
        return self.inner.generate(request)

    async def agenerate(self, request: GenerationRequest) -> GenerationResult:
        result = self.recorded(request)
        if result is not None:
            return result
        return await generate_async(self.inner, request)


class _RenderingRecordedCalls(_RecordedCalls):
    """:class:`_RecordedCalls` over a backend that renders prompts itself."""

    def prompt_ids(self, request: GenerationRequest) -> Sequence[int]:
        assert isinstance(self.inner, PromptRenderer)
        return self.inner.prompt_ids(request)


class _RecordedTools(ToolRunner):
    """The tool runner of a branched episode: the parent's recorded outcomes first (in
    order, each for the same tool and arguments), then ``inner``. One per episode."""

    def __init__(self, inner: ToolRunner, results: Sequence[ToolReturned]) -> None:
        # Not ToolRunner.__init__: no pool of its own, ``inner`` runs what is not recorded.
        self.inner = inner
        self.workers, self.timeout_s = inner.workers, inner.timeout_s
        self.results = collections.deque(results)

    async def call(self, registry: ToolRegistry, name: str,
                   arguments: Any) -> ToolOutcome:
        if not self.results:
            return await self.inner.call(registry, name, arguments)
        stored = self.results.popleft()
        if stored.name != name or _plain(stored.arguments) != _plain(dict(arguments)):
            raise BranchError(f"the recorded tool result {stored.tool_call_id!r} is for "
                              f"{stored.name} with other arguments than the call the prefix "
                              f"makes ({name}); the prefix cannot be replayed")
        return ToolOutcome(output=stored.output, is_error=stored.is_error,
                           error_type=stored.error_type, error_message=stored.error_message)

    def close(self) -> None:
        """Nothing of its own to close (``inner`` is shared)."""


def _branch_task(point: BranchPoint, *, tasks_dir: Any, registry: ToolRegistry) -> Task:
    """The parent's task with the prompt and tools the parent recorded: the task of its id
    when one resolves here (its reward and limits), else an ``unscored`` task."""
    started = point.started
    messages = tuple(dict(m) for m in started.messages)
    tools = tuple(dict(t) for t in started.tools)
    task: Task | None = None
    if started.task_id:
        try:
            task = resolve_task(started.task_id, tasks_dir=tasks_dir, registry=registry)
        except ValueError:
            task = None
    if task is None:
        return Task(task_id=started.task_id or f"branch-of-{point.parent}",
                    messages=messages, tools=tools, ground_truth=None, reward="unscored")
    return dataclasses.replace(task, messages=messages, tools=tools)


def _sampling(point: BranchPoint, config: RunConfig) -> SamplingParams:
    """The parent's recorded sampling (without its seed); the run's when it does not read."""
    recorded = dict(point.started.sampling_params)
    recorded.pop("seed", None)
    try:
        return SamplingParams.from_dict(recorded) if recorded else _run_sampling(config)
    except (TypeError, ValueError):
        return _run_sampling(config)


def _run_sampling(config: RunConfig) -> SamplingParams:
    return DEFAULT_GROUP_SAMPLING.replace(temperature=config.rollout.temperature,
                                          top_p=config.rollout.top_p,
                                          max_tokens=config.rollout.max_tokens)


def _recorded_tool_results(point: BranchPoint, task: Task) -> list[ToolReturned]:
    """The prefix's tool results that went through the tool runner (format errors and calls
    of tools the task does not offer are the loop's own outcomes)."""
    offered = {schema.get("function", {}).get("name") for schema in task.tools}
    return [r for r in point.tool_results
            if r.name != FORMAT_ERROR_TOOL_NAME and r.name in offered]


async def aplay_branch(
    *,
    log: GroupLog,
    episode_id: str,
    backend: GenerationBackend | AsyncGenerationBackend,
    tools: ToolRegistry,
    turn: int | None = None,
    checkpoint: str | None = None,
    n: int | None = None,
    group_index: int = 0,
    policy_version: int | None = None,
    run_config: RunConfig | None = None,
    sampling: SamplingParams | None = None,
    max_turns: int | None = None,
    max_total_tokens: int | None = None,
    tool_runner: ToolRunner | None = None,
    gate: asyncio.Semaphore | None = None,
    tasks_dir: Any = None,
) -> GroupResult:
    """Start ``n`` new episodes (default: the run's ``group_size``) from ``turn`` (LLM calls
    kept) or ``checkpoint`` of the stored episode ``episode_id``, in the parent's run, and play
    them concurrently (module docstring); returns their group.

    ``log`` is read (the parent's events, the run's configuration) and appended to. The new
    calls are generated by ``backend``, which must hold ``policy_version``'s weights
    (default: the parent's policy version, recorded in the new episodes); the prefix's calls
    keep their own versions.
    ``sampling`` (default: the parent's recorded sampling), ``max_turns`` and
    ``max_total_tokens`` (default: the run's ``RunConfig.rollout``) are the loop's; the task is
    the parent's task id resolved in the built-in ids and ``tasks_dir`` (its reward), with the
    parent's recorded prompt and tools, or an ``unscored`` task when the id resolves nowhere.

    Raises ``NotFoundError`` naming the episode when there is none,
    :class:`~workers.rollout.branch_point.BranchNotFound` naming the turn or checkpoint when
    the episode has no such one, ValueError naming ``n``, ``turn``, ``group_index``,
    ``policy_version`` or ``max_turns`` when out of range (``max_turns`` below the turns the
    prefix keeps), and the log's errors. A prefix that does not replay ends each episode
    ``error`` (:class:`BranchError`), as any failure inside an episode does."""
    whole_number("group_index", group_index, minimum=0)
    events: list[Event] = await asyncio.to_thread(log.read_episode, episode_id)
    point = branch_point(episode_id, events, turn=turn, checkpoint=checkpoint)
    run_id = point.started.run_id
    config = (run_config if run_config is not None
              else await asyncio.to_thread(log.run_config, run_id))
    size = check_branch_size(config.group_size if n is None else n)
    if policy_version is None:
        policy_version = point.started.policy_version
    whole_number("policy_version", policy_version, minimum=0)
    task = _branch_task(point, tasks_dir=tasks_dir, registry=tools)
    turns = task.max_turns or (max_turns if max_turns is not None
                               else config.rollout.max_turns)
    whole_number("max_turns", turns)
    if point.kept_turns > turns:
        raise ValueError(f"max_turns ({turns}) is below the {point.kept_turns} assistant turns "
                         f"the prefix of episode {episode_id!r} keeps at turn {point.turn}")
    total = max_total_tokens if max_total_tokens is not None else config.rollout.max_total_tokens
    whole_number("max_total_tokens", total)
    if sampling is None:
        sampling = _sampling(point, config)
    prompt: RunPrompt | None = await asyncio.to_thread(run_prompt, config, backend=backend)
    tokenizer = (prompt.tokenizer if prompt is not None
                 else getattr(backend, "tokenizer", None))
    group_id = branch_group_id(episode_id, point.turn, point.checkpoint, group_index)
    writer = EpisodeWriter(log, namespace=uuid.uuid5(_NAMESPACE, group_id))
    runner = tool_runner if tool_runner is not None else default_tool_runner()
    recorded_results = _recorded_tool_results(point, task)
    wrapper = (_RenderingRecordedCalls if isinstance(backend, PromptRenderer)
               else _RecordedCalls)

    async def play_slot(slot: int) -> SlotOutcome:
        aborted: list[str] = []
        for attempt in range(MAX_ATTEMPTS):
            child = episode_id_for(group_id, slot, attempt)
            state = await asyncio.to_thread(log.stream_state, child)
            if state.finished:
                return SlotOutcome(slot, child, state.status, state.reward, False,
                                   tuple(aborted))
            if state.version > 0:
                if not await asyncio.to_thread(abort_episode, writer, child, state.version,
                                              delivered="branch"):
                    return SlotOutcome(slot, child, None, None, False, tuple(aborted))
                aborted.append(child)
                continue
            try:
                result = await arun_episode(
                    task=task, backend=wrapper(backend, point.calls, tokenizer, sampling.stop),
                    tools=tools, sink=writer, run_id=run_id,
                    sampling=sampling.replace(seed=episode_seed(child)), rollback=config,
                    group_id=group_id, episode_id=child, max_turns=turns,
                    max_total_tokens=total, agent=point.agent, policy_version=policy_version,
                    tool_runner=_RecordedTools(runner, recorded_results), prompt=prompt,
                    gate=gate, branched_from=point.branched_from())
            except (ConflictError, IdempotencyError):
                return SlotOutcome(slot, child, None, None, False, tuple(aborted))
            return SlotOutcome(slot, child, result.status,
                               None if result.reward is None else result.reward.value, True,
                               tuple(aborted))
        return SlotOutcome(slot, episode_id_for(group_id, slot, MAX_ATTEMPTS - 1), "aborted",
                           None, False, tuple(aborted))

    slots = await asyncio.gather(*(play_slot(slot) for slot in range(size)))
    return GroupResult(run_id, task.task_id, group_id, policy_version, tuple(slots))


def play_branch(**kwargs: Any) -> GroupResult:
    """:func:`aplay_branch` for callers without an event loop (same keyword arguments and
    errors)."""
    return run_sync(aplay_branch(**kwargs))


def branch_task(episode_id: str, *, settings: Any, turn: int | None = None,
                checkpoint: str | None = None, n: int | None = None,
                group_index: int = 0) -> GroupResult:
    """The rollout worker's side of a branch (``trajstore.branch_episode``): the worker's log,
    tools and engine (:mod:`workers.rollout.worker`), the engine brought to the parent's policy
    version, the branch played on the worker's event loop. Errors of :func:`aplay_branch`."""
    from workers.rollout.runtime import worker_runtime
    from workers.rollout.worker import worker_log, worker_tools
    from workers.rollout.worker_engine import worker_engine

    log = worker_log(settings)
    events = log.read_episode(episode_id)
    point = branch_point(episode_id, events, turn=turn, checkpoint=checkpoint)
    run_id = point.started.run_id
    config = log.run_config(run_id)
    check_branch_size(config.group_size if n is None else n)
    policy = log.policy(run_id, point.started.policy_version)
    engine = worker_engine(config, settings=settings)
    runtime = worker_runtime(settings.rollout_concurrency)
    tools = worker_tools()

    async def play() -> GroupResult:
        async with runtime.weights.hold((id(engine), run_id, policy.version),
                                        lambda: engine.ensure(run_id, policy,
                                                              report=log.policy_served)):
            return await aplay_branch(
                log=log, episode_id=episode_id, backend=engine.backend, tools=tools,
                turn=turn, checkpoint=checkpoint, n=n, group_index=group_index,
                policy_version=policy.version, run_config=config, gate=runtime.episodes,
                tasks_dir=settings.data_dir / "tasks")

    return runtime.call(play)
