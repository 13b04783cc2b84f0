"""Rolling out one GRPO group: the n episodes of one task at one policy version, n being
the run's ``RunConfig.group_size`` (the size the trainer leases complete groups at).

Identity is deterministic, so a redelivered task finds what an earlier delivery did:

- ``group_id = uuid5(run, task, policy version, group index)``;
- the episode of slot k (0 ≤ k < n) is ``<group_id>-<k>``, and its replacement after an
  abandoned attempt ``<group_id>-<k>-r<attempt>``;
- event ids are ``uuid5(group namespace, "<episode_id>/<version>")`` and every append expects
  the version the previous one left (:class:`~workers.rollout.episode_writer.EpisodeWriter`),
  so a retried append is stored once and two workers never interleave in one episode;
- each episode samples with its own seed, derived from its id.

The group's slots play concurrently (:func:`aplay_group`; :func:`play_group` is its
synchronous wrapper), their requests batched by the backend. For each slot the log is
looked at first:

- no stream: the episode is played (``episode_started`` … ``reward_assigned``,
  ``episode_finished``). Another worker that got there first makes the first append conflict:
  the slot is left to it;
- finished: it is counted, not played again;
- started but unfinished (the worker that played it died): it is resumed. Its stored events
  are read and the episode is played again with the same seed, taking each recorded LLM call
  and tool result from the log instead of generating or running it again, and goes on from
  the last recorded call, its events appended after the stored ones at the version they end
  at (a worker still writing it makes that append conflict, and the slot is left to that
  worker). See "Resume" in :mod:`workers.rollout.loop`: a log the replay does not reproduce
  ends the episode ``error`` with the reason. Through a log that cannot read a stream's
  events (one without ``stream_events``) the episode is closed as ``aborted`` instead, as the
  sweep would, and the slot's next attempt is played.

So a group never holds more than n episodes that were played to the end.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import uuid
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

from store.arguments import whole_number
from store.errors import ConflictError, IdempotencyError
from store.events import EpisodeFinished, Event, RewardAssigned, RunConfig
from workers.engines.backend import AsyncGenerationBackend, GenerationBackend, SamplingParams
from workers.engines.prompt import RunPrompt, run_prompt
from workers.rollout.agent_tasks import Task
from workers.rollout.aio import run_sync
from workers.rollout.episode_writer import EpisodeWriter
from workers.rollout.group_log import GroupLog
from workers.rollout.loop import arun_episode
from workers.rollout.tool_runner import ToolRunner
from workers.rollout.tools import ToolRegistry

__all__ = [
    "DEFAULT_GROUP_SAMPLING",
    "MAX_ATTEMPTS",
    "GroupResult",
    "SlotOutcome",
    "abort_episode",
    "aplay_group",
    "episode_id_for",
    "episode_seed",
    "group_id_for",
    "play_group",
    "seed_root",
]

_NAMESPACE = uuid.UUID("0b7f4f6e-8d0e-4a59-8a57-5b2f3d1c9e21")
#: How many times one slot is attempted before the group gives it up.
MAX_ATTEMPTS = 5
#: Sampling of group rollouts unless the caller says otherwise (seeds come per episode).
DEFAULT_GROUP_SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=256)


def group_id_for(run_id: str, task_id: str, policy_version: int, group_index: int) -> str:
    """The group id of (run, task, policy version, group index); the same inputs always give
    the same id."""
    key = json.dumps([run_id, task_id, policy_version, group_index])
    return str(uuid.uuid5(_NAMESPACE, key))


def episode_id_for(group_id: str, slot: int, attempt: int = 0) -> str:
    """The episode id of ``slot`` of ``group_id`` at ``attempt`` (0: the first)."""
    return f"{group_id}-{slot}" if attempt == 0 else f"{group_id}-{slot}-r{attempt}"


def episode_seed(episode_id: str) -> int:
    """The sampling seed of an episode, a non-negative 31-bit integer derived from its id."""
    return uuid.uuid5(_NAMESPACE, episode_id).int % (2**31)


def seed_root(config: RunConfig, group_id: str, task_id: str, policy_version: int,
               group_index: int) -> str:
    """What the seeds of a group's episodes derive from: with the run's sampling seed
    (``RolloutConfig.seed``), the group's place in the run; without, its id."""
    seed = config.rollout.seed
    if seed is None:
        return group_id
    return json.dumps(["seed", seed, task_id, policy_version, group_index])


@dataclass(frozen=True)
class SlotOutcome:
    """What became of one slot: the episode that holds it, its status and reward
    (``None`` while another worker plays it), and whether this call played it."""

    slot: int
    episode_id: str
    status: str | None
    reward: float | None
    played: bool
    aborted: tuple[str, ...] = ()
    resumed: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"slot": self.slot, "episode_id": self.episode_id, "status": self.status,
                "reward": self.reward, "played": self.played, "aborted": list(self.aborted),
                "resumed": self.resumed}


@dataclass(frozen=True)
class GroupResult:
    """A group's slots after :func:`play_group`."""

    run_id: str
    task_id: str
    group_id: str
    policy_version: int
    slots: tuple[SlotOutcome, ...]

    @property
    def played(self) -> int:
        """Episodes this call played."""
        return sum(1 for slot in self.slots if slot.played)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (the Celery task's return value)."""
        return {"run_id": self.run_id, "task_id": self.task_id, "group_id": self.group_id,
                "policy_version": self.policy_version, "played": self.played,
                "slots": [slot.to_dict() for slot in self.slots]}


def abort_episode(writer: EpisodeWriter, episode_id: str, version: int, *,
                  delivered: str = "rollout task") -> bool:
    """Close an abandoned episode (at ``version``) as ``aborted``, saying that its
    ``delivered`` (the task that plays it) came again before it finished; False when its
    writer turned out to be alive (the append conflicts)."""
    writer.start(episode_id, version)
    try:
        writer.append(episode_id, [EpisodeFinished(
            status="aborted", occurred_at=dt.datetime.now(dt.UTC),
            reason=f"its {delivered} was delivered again before the episode finished: the "
                   "worker playing it is gone; the slot is played again")])
    except ConflictError:
        return False
    return True


@dataclass(frozen=True)
class _Plan:
    """What every slot of one group shares."""

    log: GroupLog
    run_id: str
    task: Task
    group_id: str
    backend: Any
    tools: ToolRegistry
    writer: EpisodeWriter
    config: RunConfig
    seed_root: str
    sampling: SamplingParams
    policy_version: int
    max_turns: int
    max_total_tokens: int
    tool_runner: ToolRunner | None
    gate: asyncio.Semaphore | None
    prompt: RunPrompt | None
    call_guard: Callable[[], AbstractAsyncContextManager[None]] | None = None


async def _play_slot(plan: _Plan, slot: int) -> SlotOutcome:
    """Settle one slot: count a finished episode, resume an abandoned one (or close it and
    play the next attempt), or play it (module docstring)."""
    aborted: list[str] = []
    outcome: SlotOutcome | None = None
    read_events = getattr(plan.log, "stream_events", None)
    for attempt in range(MAX_ATTEMPTS):
        episode_id = episode_id_for(plan.group_id, slot, attempt)
        state = await asyncio.to_thread(plan.log.stream_state, episode_id)
        if state.finished:
            outcome = SlotOutcome(slot, episode_id, state.status, state.reward, False)
            break
        resume: list[Event] | None = None
        if state.version > 0 and read_events is not None:
            stored: list[Event] = list(await asyncio.to_thread(read_events, episode_id))
            if stored and isinstance(stored[-1], EpisodeFinished):  # it finished meanwhile
                reward = next((e.value for e in reversed(stored)
                               if isinstance(e, RewardAssigned)), None)
                outcome = SlotOutcome(slot, episode_id, stored[-1].status, reward, False)
                break
            plan.writer.start(episode_id, len(stored))
            resume = stored
        elif state.version > 0:
            if not await asyncio.to_thread(abort_episode, plan.writer, episode_id, state.version):
                outcome = SlotOutcome(slot, episode_id, None, None, False)
                break
            aborted.append(episode_id)
            continue
        try:
            result = await arun_episode(
                task=plan.task, backend=plan.backend, tools=plan.tools, sink=plan.writer,
                run_id=plan.run_id, sampling=plan.sampling.replace(
                    seed=episode_seed(episode_id_for(plan.seed_root, slot, attempt))),
                rollback=plan.config, group_id=plan.group_id, episode_id=episode_id,
                max_turns=plan.max_turns, max_total_tokens=plan.max_total_tokens,
                policy_version=plan.policy_version, tool_runner=plan.tool_runner,
                prompt=plan.prompt, gate=plan.gate, resume=resume or None,
                call_guard=plan.call_guard)
        except (ConflictError, IdempotencyError):
            # Another delivery of this task got to the slot first: it is theirs.
            outcome = SlotOutcome(slot, episode_id, None, None, False)
            break
        outcome = SlotOutcome(slot, episode_id, result.status,
                              None if result.reward is None else result.reward.value, True,
                              resumed=bool(resume))
        break
    if outcome is None:
        outcome = SlotOutcome(slot, episode_id_for(plan.group_id, slot, MAX_ATTEMPTS - 1),
                              "aborted", None, False)
    return SlotOutcome(outcome.slot, outcome.episode_id, outcome.status, outcome.reward,
                       outcome.played, tuple(aborted), outcome.resumed)


async def aplay_group(
    *,
    log: GroupLog,
    run_id: str,
    task: Task,
    backend: GenerationBackend | AsyncGenerationBackend,
    tools: ToolRegistry,
    policy_version: int,
    group_index: int = 0,
    run_config: RunConfig | None = None,
    sampling: SamplingParams | None = None,
    max_turns: int = 8,
    max_total_tokens: int = 4096,
    tool_runner: ToolRunner | None = None,
    gate: asyncio.Semaphore | None = None,
    call_guard: Callable[[], AbstractAsyncContextManager[None]] | None = None,
) -> GroupResult:
    """Play the episodes of ``task``'s group at ``policy_version`` concurrently (module
    docstring), appending their events to ``log``.

    ``run_config`` (read from ``log`` when None) is the run's configuration, the one source
    of the group's behaviour: ``group_size`` episodes, the rollback rules, the prompt
    rendering (the run's tokenizer and chat template, as replay renders them,
    :func:`~workers.engines.prompt.run_prompt`) and, unless ``sampling`` is given, the
    sampling and limits of ``RunConfig.rollout`` (which then also sets ``max_turns`` and
    ``max_total_tokens``); each episode's seed is derived from its id, or from the run's
    sampling seed and its place in the run when the run has one (``RolloutConfig.seed``).
    ``backend`` must already hold that policy's weights. ``gate``, when given, is held by
    each episode while it plays, up to the wait for its last events to be stored (the
    worker's bound on episodes in flight across groups, :func:`~workers.rollout.loop.arun_episode`);
    ``tool_runner`` runs the tool calls (the process's default when None); ``call_guard`` is
    entered around each LLM call an episode generates (the worker's take-up of a newer
    policy under ``rollout.continue_across_updates``). Raises ValueError
    for a negative ``group_index`` or ``policy_version``, ``TokenizerNotFound`` when the
    run's tokenizer cannot be loaded here, and the log's errors (``NotFoundError`` for an
    unknown run, ``TransientError`` when it is unreachable). Failures inside an episode
    (backend, tools, reward, the template) end that episode with status ``error`` and do
    not raise.
    """
    for name, value, low in (("group_index", group_index, 0),
                             ("policy_version", policy_version, 0)):
        whole_number(name, value, minimum=low)
    if not isinstance(task, Task):
        raise TypeError(f"task must be a Task, got {type(task).__name__}")
    config = (run_config if run_config is not None
              else await asyncio.to_thread(log.run_config, run_id))
    if sampling is None:
        # The run's own rollout settings (RunConfig.rollout) unless the caller overrides them.
        sampling = DEFAULT_GROUP_SAMPLING.replace(
            temperature=config.rollout.temperature, top_p=config.rollout.top_p,
            max_tokens=config.rollout.max_tokens)
        max_turns = config.rollout.max_turns
        max_total_tokens = config.rollout.max_total_tokens
    prompt = await asyncio.to_thread(run_prompt, config, backend=backend)
    group_id = group_id_for(run_id, task.task_id, policy_version, group_index)
    plan = _Plan(log=log, run_id=run_id, task=task, group_id=group_id, backend=backend,
                 tools=tools, writer=EpisodeWriter(log, namespace=uuid.uuid5(_NAMESPACE,
                                                                             group_id)),
                 config=config, seed_root=seed_root(config, group_id, task.task_id,
                                                     policy_version, group_index),
                 sampling=sampling, policy_version=policy_version,
                 max_turns=max_turns, max_total_tokens=max_total_tokens,
                 tool_runner=tool_runner, gate=gate, prompt=prompt, call_guard=call_guard)
    slots = await asyncio.gather(*(_play_slot(plan, slot)
                                   for slot in range(config.group_size)))
    return GroupResult(run_id, task.task_id, group_id, policy_version, tuple(slots))


def play_group(
    *,
    log: GroupLog,
    run_id: str,
    task: Task,
    backend: GenerationBackend | AsyncGenerationBackend,
    tools: ToolRegistry,
    policy_version: int,
    group_index: int = 0,
    run_config: RunConfig | None = None,
    sampling: SamplingParams | None = None,
    max_turns: int = 8,
    max_total_tokens: int = 4096,
    tool_runner: ToolRunner | None = None,
) -> GroupResult:
    """:func:`aplay_group` for callers without an event loop (same arguments and errors):
    the group's episodes play concurrently in a private event loop."""
    return run_sync(aplay_group(
        log=log, run_id=run_id, task=task, backend=backend, tools=tools,
        policy_version=policy_version, group_index=group_index, run_config=run_config,
        sampling=sampling, max_turns=max_turns, max_total_tokens=max_total_tokens,
        tool_runner=tool_runner))
