"""The rollout worker's side of a ``rollout_group`` task: which log, engine, task and tools.

The log is the database (the worker process's store; replay workers follow the log and queue
the replay of each finished episode) unless the settings name an ``api_url``: then events go
through the HTTP API with ``api_key``, and the credentials of a remote agent's episodes are
minted there too. The engine is the process's
:func:`~workers.rollout.worker_engine.worker_engine`, brought to the run's newest policy; the group
plays on the process's :mod:`~workers.rollout.runtime` event loop, its episodes concurrent with
those of the other groups the worker's threads hand it. Tasks are
resolved by id: built-in ids (``arith-<seed>-<index>``, ``fc-<seed>-<index>``) or the JSONL
files of ``<data_dir>/tasks``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

from store.arguments import whole_number
from store.events import RunConfig
from store.settings import Settings
from workers.rollout.agent_tasks import Task, resolve_task
from workers.rollout.group import GroupResult, aplay_group
from workers.rollout.group_log import ApiGroupLog, GroupLog, StoreGroupLog
from workers.rollout.runtime import WeightsGate, worker_runtime
from workers.rollout.tools import ToolRegistry

if TYPE_CHECKING:
    from workers.rollout.credentials import EpisodeCredentials
    from workers.rollout.worker_engine import RolloutEngine

__all__ = ["episode_credentials", "run_rollout_group", "worker_log", "worker_tools"]

_lock = threading.Lock()
_logs: dict[tuple[str, str], GroupLog] = {}
_tools: ToolRegistry | None = None


def worker_log(settings: Settings) -> GroupLog:
    """The log this process appends to (module docstring), made once per process. Raises
    ValueError when ``api_url`` is set without ``api_key``."""
    if settings.api_url is not None and not settings.api_key:
        raise ValueError("api_url is set but api_key is not: the API needs a key")
    key = (settings.api_url or "", settings.api_key or "")
    with _lock:
        log = _logs.get(key)
        if log is None:
            if settings.api_url is not None:
                log = ApiGroupLog(settings.api_url, api_key=settings.api_key or "")
            else:
                from workers.celery_tasks import worker_store

                # Finished episodes are queued for replay by the replay workers' follower
                # of the log (workers.replay.jobs.dispatch), as every other episode is.
                log = StoreGroupLog(worker_store())
            _logs[key] = log
        return log


def worker_tools() -> ToolRegistry:
    """The process's tool registry (the built-in tools), made once."""
    global _tools
    with _lock:
        if _tools is None:
            from workers.rollout.builtin_tools import default_tool_registry

            _tools = default_tool_registry()
        return _tools


@contextlib.asynccontextmanager
async def _on_newest_policy(weights: WeightsGate, engine: RolloutEngine, log: GroupLog,
                            run_id: str) -> AsyncIterator[None]:
    """Around one LLM call of a run with ``rollout.continue_across_updates``: the engine is
    brought to the run's newest policy first when it holds an older one of the run
    (:meth:`~workers.rollout.runtime.WeightsGate.calling`; the take-up is reported as any)."""
    newest = await asyncio.to_thread(log.policy, run_id)
    key = id(engine)

    def older(current: object) -> bool:
        return (isinstance(current, tuple) and len(current) == 3 and current[0] == key
                and current[1] == run_id and current[2] < newest.version)

    async with weights.calling((key, run_id, newest.version),
                               lambda: engine.ensure(run_id, newest, report=log.policy_served),
                               follows=older):
        yield


def run_rollout_group(run_id: str, task_id: str, *, settings: Settings,
                      group_index: int = 0, policy_version: int | None = None,
                      lease: bool = False) -> GroupResult:
    """Play (or complete) the group of ``task_id`` at the run's newest policy version (at
    ``policy_version`` when given, so that which policy plays a group does not depend on
    when the worker takes it; ValueError when the run has no such version), with
    the run's ``group_size`` episodes rendered with the run's tokenizer and chat template
    (:func:`~workers.rollout.group.aplay_group`). Raises ValueError for an unknown task, a
    bad ``group_index`` or a run whose model is not a local folder; ``TokenizerNotFound``
    when the run's tokenizer cannot be loaded here; ``NotFoundError`` for an unknown run;
    ``TransientError`` when the log is unreachable (the task is retried). With ``lease``
    (a Celery delivery), the group is leased while it plays, at the policy version resolved
    here, so a surviving worker queues it again within seconds if this one dies
    (:mod:`workers.rollout.liveness`)."""
    if not lease:
        return _play_rollout_group(run_id, task_id, settings=settings, group_index=group_index,
                                   policy_version=policy_version, pin=None)
    from workers.rollout.liveness import group_lease

    # Leased before anything else (the engine may take long to load): a worker killed at
    # any moment of the task has its group queued again.
    with group_lease(settings, "trajstore.rollout_group", [run_id, task_id],
                     {"group_index": group_index, "policy_version": policy_version}) as held:
        return _play_rollout_group(run_id, task_id, settings=settings, group_index=group_index,
                                   policy_version=policy_version, pin=held.pin)


def _play_rollout_group(run_id: str, task_id: str, *, settings: Settings, group_index: int,
                        policy_version: int | None,
                        pin: Callable[[dict[str, Any]], None] | None) -> GroupResult:
    from workers.rollout.worker_engine import worker_engine

    log = worker_log(settings)
    config = log.run_config(run_id)
    tools = worker_tools()
    task = resolve_task(task_id, tasks_dir=settings.data_dir / "tasks", registry=tools)
    if policy_version is not None:
        whole_number("policy_version", policy_version, minimum=0)
    policy = log.policy(run_id, policy_version)
    if pin is not None:  # a requeued group is this group, whatever the run's policy is by then
        pin({"group_index": group_index, "policy_version": policy.version})
    if config.remote_agent is not None:
        return _remote_group(log, run_id, task, config, policy.version, settings=settings,
                             group_index=group_index)
    engine = worker_engine(config, settings=settings)
    runtime = worker_runtime(settings.rollout_concurrency)

    call_guard = None
    if config.rollout.continue_across_updates:
        def call_guard() -> AbstractAsyncContextManager[None]:
            return _on_newest_policy(runtime.weights, engine, log, run_id)

    async def play() -> GroupResult:
        async with runtime.weights.hold((id(engine), run_id, policy.version),
                                        lambda: engine.ensure(run_id, policy,
                                                              report=log.policy_served)):
            return await aplay_group(
                log=log, run_id=run_id, task=task, backend=engine.backend, tools=tools,
                policy_version=policy.version, group_index=group_index, run_config=config,
                gate=runtime.episodes, call_guard=call_guard)

    return runtime.call(play)


def episode_credentials(log: GroupLog, run_id: str, *, settings: Settings
                        ) -> EpisodeCredentials:
    """Who mints the credentials of ``run_id``'s remote-agent episodes for a worker writing
    to ``log`` (:mod:`workers.rollout.credentials`): the worker's database (keys of the
    run's project, at the worker's scrypt cost), or the API it writes through (with its
    ``admin`` key). Raises TypeError for a log that is neither."""
    from workers.rollout.credentials import ApiCredentials, StoreCredentials

    if isinstance(log, ApiGroupLog):
        return ApiCredentials(log)
    if isinstance(log, StoreGroupLog):
        from store import queries

        record = queries.run_record(log.store, run_id) or {}
        project = str(record.get("data", {}).get("project") or "default")
        return StoreCredentials(log.store.db, project=project, scrypt=(
            settings.api_key_scrypt_n, settings.api_key_scrypt_r, settings.api_key_scrypt_p))
    raise TypeError(f"cannot mint credentials through a {type(log).__name__}: a "
                    "StoreGroupLog or an ApiGroupLog mints them")


def _remote_group(log: GroupLog, run_id: str, task: Task, config: RunConfig,
                  policy_version: int, *, settings: Settings, group_index: int
                  ) -> GroupResult:
    """The group played by the run's RolloutServer (:mod:`workers.rollout.remote_agent`):
    no engine is loaded here; the episodes' credentials are minted where the worker writes
    (:func:`episode_credentials`: its database, or the API of ``api_url``)."""
    from workers.rollout.remote_agent import aplay_remote_group

    credentials = episode_credentials(log, run_id, settings=settings)
    runtime = worker_runtime(settings.rollout_concurrency)

    async def play() -> GroupResult:
        return await aplay_remote_group(
            log=log, credentials=credentials, run_id=run_id, task=task, config=config,
            policy_version=policy_version, settings=settings, group_index=group_index,
            gate=runtime.episodes)

    return runtime.call(play)
