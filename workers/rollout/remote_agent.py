"""A user's RolloutServer plays a run's groups: this store is its whole trainer.

A run whose ``RunConfig.remote_agent`` names a RolloutServer (its URL and the protocol
revision it speaks, TrainGate's remote-rollout protocol) has its groups played here instead of
by the agent loop. For each slot of the group (``<group_id>-<k>``, as
:mod:`workers.rollout.group` names them) the worker:

1. appends the episode's ``episode_started`` (run, group, task, prompt, tools, sampling,
   policy version);
2. mints a credential that can record only that episode (an ``ingest`` key scoped to the
   run and the episode, expiring ``timeout_s`` + 60 s from now), in the worker's database or
   through the API it writes to (:mod:`workers.rollout.credentials`); any other episode or
   route is 403 with it. A credential that cannot be minted for a reason other than an
   unreachable database or API (a worker key that is not ``admin``, say) ends the episode
   ``error`` with the reason; an unreachable one raises ``TransientError`` (the group's
   task is retried, and replays the slot);
3. calls the RolloutServer with ``rollout_id`` = the episode id, ``server_url`` = this
   store's API (``TRAJSTORE_REMOTE_AGENT_STORE_URL``) and the credential as
   ``callback_api_key`` (``api_key`` in the asynchronous revision): ``POST {url}/rollout``,
   whose answer is the RolloutResponse, or ``POST {url}/v1/rollout/init`` (2xx at once) and
   then waits for the server's report to ``/v1/rollout/completed`` to finish the episode.
   The server's calls to ``/v1/completions`` and ``/v1/chat/completions`` record the
   episode's ``llm_called`` with exact token ids and masks (the trainer side);
4. records the reward: the task's reward function applied to the final messages, or, for a
   task scored elsewhere (``unscored``), the reward the server reports; then
   ``episode_finished`` (``completed``, ``truncated`` for a turn or token limit, ``error``
   with the reason);
5. revokes the credential, whatever happened (a revocation that fails is logged: the
   credential still expires on its own).

Slots play concurrently, at most ``remote_agent.max_in_flight`` rollouts of one run at once
across every rollout worker process (a semaphore in the process, then a slot of the run's in
the broker, :mod:`workers.rollout.run_slots`), and within each worker's bound on episodes in
flight.

Failures end the episode ``error`` with the reason and never raise: a RolloutServer that
cannot be reached (connection refused, DNS, timeout) or answers 502/503/504 before the
rollout recorded anything is tried ``1 + retries`` times in all, 0.5 s, 1 s, 2 s … apart,
and the reason says how many; any other HTTP status ends it at once; a RolloutResponse that
breaks the contract (not a JSON object, ``status`` not COMPLETED/ERROR, another
``rollout_id``, ``final_messages`` not a list of messages, a reward that is not a number)
names the field. With ``protocol: auto`` the revision is probed once per URL: ``GET`` on
``/v1/rollout/init`` and on ``/rollout`` (a server that has the route answers 405 or 2xx/422,
one that lacks it 404); asynchronous when it has ``init``, synchronous otherwise; neither is
an error naming the setting.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

import httpx

from store import errors
from store.events import (
    EpisodeFinished,
    EpisodeStarted,
    Event,
    LLMCalled,
    RemoteAgentConfig,
    RewardAssigned,
    RunConfig,
)
from store.settings import Settings
from workers.rollout.agent_tasks import Task
from workers.rollout.credentials import EpisodeCredentials
from workers.rollout.group import (
    MAX_ATTEMPTS,
    GroupResult,
    SlotOutcome,
    abort_episode,
    episode_id_for,
    episode_seed,
    group_id_for,
    seed_root,
)
from workers.rollout.group_log import GroupLog
from workers.rollout.rewards import Reward, Transcript
from workers.rollout.run_slots import run_slot

__all__ = ["RemoteAgentError", "aplay_remote_group", "detect_protocol", "rollout_body"]

log = logging.getLogger(__name__)

_NAMESPACE = uuid.UUID("2d1e6f0a-5b7c-4e3d-9f21-8a6b4c3d2e10")
_RETRY_STATUS = frozenset({502, 503, 504})
_TRUNCATED = ("max_turns", "max_tokens", "length")
#: Seconds between looks at the log while an asynchronous rollout plays.
_POLL_S = 0.2
#: Protocol revisions probed, per RolloutServer URL (``protocol: auto``).
_detected: dict[str, str] = {}
#: Per-run bound on rollouts in flight in this process: run id -> (limit, semaphore).
_gates: dict[str, tuple[int, asyncio.Semaphore]] = {}


class RemoteAgentError(Exception):
    """The RolloutServer failed or broke the contract; the message is the episode's reason."""


@dataclass(frozen=True)
class _Plan:
    log: GroupLog
    credentials: EpisodeCredentials
    run_id: str
    task: Task
    group_id: str
    agent: RemoteAgentConfig
    protocol: str
    config: RunConfig
    policy_version: int
    seed_root: str
    store_url: str
    tokenizer_name: str | None
    client: httpx.AsyncClient
    gate: asyncio.Semaphore | None
    run_gate: asyncio.Semaphore
    settings: Settings


def _gate_of(run_id: str, limit: int) -> asyncio.Semaphore:
    held = _gates.get(run_id)
    if held is None or held[0] != limit:
        held = _gates[run_id] = (limit, asyncio.Semaphore(limit))
    return held[1]


async def detect_protocol(client: httpx.AsyncClient, url: str) -> str:
    """The revision the RolloutServer at ``url`` speaks (module docstring); raises
    RemoteAgentError naming the setting when neither route answers."""
    if url in _detected:
        return _detected[url]

    async def has(path: str) -> bool:
        try:
            answer = await client.get(url + path, timeout=10.0)
        except httpx.HTTPError as exc:
            raise RemoteAgentError(f"the RolloutServer at {url} is unreachable while probing "
                                   f"its protocol revision ({type(exc).__name__})") from None
        return answer.status_code != 404

    if await has("/v1/rollout/init"):
        found = "async"
    elif await has("/rollout"):
        found = "sync-chat"
    else:
        raise RemoteAgentError(f"the RolloutServer at {url} serves neither /rollout nor "
                               "/v1/rollout/init: set remote_agent.protocol")
    _detected[url] = found
    return found


def rollout_body(plan: _Plan, episode_id: str, token: str, seed: int) -> dict[str, Any]:
    """The RolloutRequest of one rollout, in the field names of the plan's revision."""
    rollout = plan.config.rollout
    sampling = {"temperature": rollout.temperature, "top_p": rollout.top_p,
                "max_tokens": rollout.max_tokens, "logprobs": True, "seed": seed}
    body: dict[str, Any] = {
        "rollout_id": episode_id, "server_url": plan.store_url,
        "messages": [dict(m) for m in plan.task.messages],
        "max_turns": plan.task.max_turns or rollout.max_turns,
        "max_tokens_total": rollout.max_total_tokens,
        "run_id": plan.run_id, "group_id": plan.group_id,
    }
    if plan.task.tools:
        body["tools"] = [dict(t) for t in plan.task.tools]
    if plan.protocol == "async":
        body.update(completion_params=sampling, api_key=token)
    else:
        body.update(sampling_params=sampling, callback_api_key=token)
        if plan.tokenizer_name is not None:
            body["tokenizer_name"] = plan.tokenizer_name
    return body


async def _post(plan: _Plan, episode_id: str, path: str, body: dict[str, Any],
                timeout_s: float) -> httpx.Response:
    """POST to the RolloutServer, retried (module docstring) while nothing was recorded."""
    attempts = 1 + plan.agent.retries
    problem = ""
    for attempt in range(attempts):
        if attempt:
            await asyncio.sleep(0.5 * 2 ** (attempt - 1))
            # A rollout that recorded a call is under way: it is not started twice.
            if (await asyncio.to_thread(plan.log.stream_state, episode_id)).version > 1:
                break
        try:
            answer = await plan.client.post(plan.agent.url + path, json=body,
                                            timeout=timeout_s)
        except httpx.TimeoutException:
            problem = f"no answer within {timeout_s:g} s"
            continue
        except httpx.HTTPError as exc:
            problem = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            continue
        if answer.status_code in _RETRY_STATUS:
            problem = f"HTTP {answer.status_code}"
            continue
        if answer.status_code >= 400:
            raise RemoteAgentError(f"the RolloutServer answered POST {path} with HTTP "
                                   f"{answer.status_code}: {answer.text[:300]}")
        return answer
    raise RemoteAgentError(f"the RolloutServer at {plan.agent.url} failed POST {path} after "
                           f"{attempt + 1} attempt(s) (at most {attempts}: 1 + "
                           f"remote_agent.retries): {problem}")


def _contract(answer: httpx.Response, episode_id: str) -> dict[str, Any]:
    """The RolloutResponse of a synchronous answer, checked; RemoteAgentError naming the
    field that breaks the contract."""
    try:
        body = answer.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RemoteAgentError("the RolloutServer's answer is not JSON (RolloutResponse "
                               "expected)") from None
    if not isinstance(body, dict):
        raise RemoteAgentError(f"the RolloutServer's answer is a JSON "
                               f"{type(body).__name__}, not a RolloutResponse object")
    if body.get("rollout_id") not in (None, episode_id):
        raise RemoteAgentError(f"RolloutResponse field 'rollout_id' is "
                               f"{str(body['rollout_id'])[:80]!r}, not {episode_id!r}")
    if body.get("status") not in ("COMPLETED", "ERROR"):
        raise RemoteAgentError(f"RolloutResponse field 'status' must be COMPLETED or ERROR, "
                               f"got {str(body.get('status'))[:80]!r}")
    messages = body.get("final_messages")
    if body["status"] == "COMPLETED" and (
            not isinstance(messages, list)
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                       for m in messages)):
        raise RemoteAgentError("RolloutResponse field 'final_messages' must be a list of "
                               "messages with a role")
    return body


def reported_reward(body: dict[str, Any]) -> float | None:
    """The reward a RolloutResponse reports (``reward``, ``reward_score``,
    ``extra_fields.reward``, ``metrics.reward``); RemoteAgentError naming a field that holds
    something else than a finite number."""
    raw_extra, raw_metrics = body.get("extra_fields"), body.get("metrics")
    extra: dict[str, Any] = raw_extra if isinstance(raw_extra, dict) else {}
    metrics: dict[str, Any] = raw_metrics if isinstance(raw_metrics, dict) else {}
    for where, value in (("reward", body.get("reward")),
                         ("reward_score", body.get("reward_score")),
                         ("extra_fields.reward", extra.get("reward")),
                         ("metrics.reward", metrics.get("reward"))):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) \
                or value != value or abs(value) == float("inf"):
            raise RemoteAgentError(f"RolloutResponse field {where!r} must be a finite number, "
                                   f"got {str(value)[:80]!r}")
        return float(value)
    return None


def _assistant_texts(messages: list[dict[str, Any]]) -> tuple[str, ...]:
    return tuple(str(m.get("content") or "") for m in messages if m.get("role") == "assistant")


def _score(task: Task, messages: list[dict[str, Any]], status: str,
           reported: float | None) -> Reward | None:
    """The run's reward function on the final messages; the server's report when the task
    is scored elsewhere (the function gives None)."""
    reward = task.score(Transcript(messages=tuple(messages),
                                   assistant_texts=_assistant_texts(messages), status=status))
    if reward is None and reported is not None:
        return Reward(reported, {}, source="rollout_server")
    return reward


def _recorded_messages(events: list[Event]) -> list[dict[str, Any]]:
    """The conversation an episode's recorded calls end with: the last call's messages and
    its answer."""
    calls = [e for e in events if isinstance(e, LLMCalled)]
    if not calls:
        return []
    last = calls[-1]
    return [*last.messages, *([last.response] if last.response else [])]


def _event_id(episode_id: str, what: str) -> uuid.UUID:
    return uuid.uuid5(_NAMESPACE, f"{episode_id}/{what}")


async def _finish(plan: _Plan, episode_id: str, status: str, reason: str | None,
                  reward: Reward | None) -> None:
    events: list[Event] = []
    now = dt.datetime.now(dt.UTC)
    if reward is not None:
        events.append(RewardAssigned(event_id=_event_id(episode_id, "reward"), occurred_at=now,
                                     value=reward.value, components=reward.components,
                                     source=reward.source))
    events.append(EpisodeFinished(event_id=_event_id(episode_id, "finished"), occurred_at=now,
                                  status=status,  # type: ignore[arg-type]
                                  reason=None if reason is None else reason[:2000]))
    await asyncio.to_thread(plan.log.append, episode_id, events, "any")


async def _play_sync(plan: _Plan, episode_id: str, token: str, seed: int
                     ) -> tuple[str, float | None]:
    answer = await _post(plan, episode_id, "/rollout",
                         rollout_body(plan, episode_id, token, seed), plan.agent.timeout_s)
    body = _contract(answer, episode_id)
    if body["status"] == "ERROR":
        reason = (f"the RolloutServer reported ERROR ({body.get('error_category')}): "
                  f"{str(body.get('error_message'))[:500]}")
        await _finish(plan, episode_id, "error", reason, Reward(0.0, {}, source="error"))
        return "error", 0.0
    status = "truncated" if body.get("finish_reason") in _TRUNCATED else "completed"
    reward = _score(plan.task, body["final_messages"], status, reported_reward(body))
    await _finish(plan, episode_id, status, body.get("finish_reason"), reward)
    return status, None if reward is None else reward.value


async def _play_async(plan: _Plan, episode_id: str, token: str, seed: int
                      ) -> tuple[str, float | None]:
    await _post(plan, episode_id, "/v1/rollout/init",
                rollout_body(plan, episode_id, token, seed), 30.0)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + plan.agent.timeout_s
    while True:
        state = await asyncio.to_thread(plan.log.stream_state, episode_id)
        if state.finished:
            break
        if loop.time() >= deadline:
            reason = (f"the RolloutServer did not report the rollout's end to "
                      f"/v1/rollout/completed within remote_agent.timeout_s = "
                      f"{plan.agent.timeout_s:g} s")
            await _finish(plan, episode_id, "error", reason, Reward(0.0, {}, source="error"))
            return "error", 0.0
        await asyncio.sleep(_POLL_S)
    status = state.status or "completed"
    events = await asyncio.to_thread(plan.log.read_episode, episode_id)
    if status != "error":
        reward = plan.task.score(Transcript(
            messages=tuple(_recorded_messages(events)),
            assistant_texts=_assistant_texts(_recorded_messages(events)), status=status))
        if reward is not None:  # the run's reward function: after the report, as the latest
            await asyncio.to_thread(plan.log.append, episode_id, [RewardAssigned(
                event_id=_event_id(episode_id, "reward"), occurred_at=dt.datetime.now(dt.UTC),
                value=reward.value, components=reward.components, source=reward.source)],
                "any")
            return status, reward.value
    latest = next((e.value for e in reversed(events) if isinstance(e, RewardAssigned)), None)
    return status, latest


async def _play_rollout(plan: _Plan, episode_id: str, seed: int) -> tuple[str, float | None]:
    """Mint the credential, call the server, finish the episode, revoke the credential."""
    try:
        key_id, token = await asyncio.to_thread(
            plan.credentials.mint, run_id=plan.run_id, episode_id=episode_id,
            ttl_s=plan.agent.timeout_s + 60.0)
    except errors.TransientError:
        raise
    except errors.StoreError as exc:
        reason = f"the episode's credential could not be minted: {exc}"
        await _finish(plan, episode_id, "error", reason, Reward(0.0, {}, source="error"))
        return "error", 0.0
    try:
        try:
            if plan.protocol == "async":
                return await _play_async(plan, episode_id, token, seed)
            return await _play_sync(plan, episode_id, token, seed)
        except RemoteAgentError as exc:
            if (await asyncio.to_thread(plan.log.stream_state, episode_id)).finished:
                return "error", None
            await _finish(plan, episode_id, "error", str(exc), Reward(0.0, {}, source="error"))
            return "error", 0.0
    finally:
        try:
            await asyncio.to_thread(plan.credentials.revoke, episode_id=episode_id,
                                    key_id=key_id)
        except errors.StoreError as exc:
            # The episode is recorded whatever happens here; the key expires on its own.
            log.warning("could not revoke credential %s of episode %s (%s); it expires "
                        "%g s after it was minted", key_id, episode_id, exc,
                        plan.agent.timeout_s + 60.0)


async def _play_slot(plan: _Plan, slot: int) -> SlotOutcome:
    aborted: list[str] = []
    for attempt in range(MAX_ATTEMPTS):
        episode_id = episode_id_for(plan.group_id, slot, attempt)
        state = await asyncio.to_thread(plan.log.stream_state, episode_id)
        if state.finished:
            return SlotOutcome(slot, episode_id, state.status, state.reward, False,
                               tuple(aborted))
        if state.version > 0:
            # A remote rollout cannot be resumed half-way (the server's conversation is
            # gone): the abandoned episode is closed and the slot played again.
            from workers.rollout.episode_writer import EpisodeWriter

            writer = EpisodeWriter(plan.log, namespace=uuid.uuid5(_NAMESPACE, plan.group_id))
            if not await asyncio.to_thread(abort_episode, writer, episode_id, state.version):
                return SlotOutcome(slot, episode_id, None, None, False, tuple(aborted))
            aborted.append(episode_id)
            continue
        # As the agent loop's groups: from the episode id, or from the run's seed and the
        # episode's place in the run when the run sets one.
        seed = episode_seed(episode_id_for(plan.seed_root, slot, attempt))
        rollout = plan.config.rollout
        try:
            await asyncio.to_thread(plan.log.append, episode_id, [EpisodeStarted(
                event_id=_event_id(episode_id, "started"),
                occurred_at=dt.datetime.now(dt.UTC), run_id=plan.run_id,
                group_id=plan.group_id, task_id=plan.task.task_id,
                messages=[dict(m) for m in plan.task.messages],
                tools=[dict(t) for t in plan.task.tools],
                sampling_params={"temperature": rollout.temperature, "top_p": rollout.top_p,
                                 "max_tokens": rollout.max_tokens, "seed": seed},
                policy_version=plan.policy_version)], 0)
        except Exception as exc:
            from store.errors import ConflictError, IdempotencyError

            if isinstance(exc, ConflictError | IdempotencyError):
                return SlotOutcome(slot, episode_id, None, None, False, tuple(aborted))
            raise
        # The run's bound: first among this process's episodes, then across processes.
        async with plan.run_gate, run_slot(plan.settings, plan.run_id,
                                           plan.agent.max_in_flight):
            if plan.gate is not None:
                async with plan.gate:
                    status, reward = await _play_rollout(plan, episode_id, seed)
            else:
                status, reward = await _play_rollout(plan, episode_id, seed)
        return SlotOutcome(slot, episode_id, status, reward, True, tuple(aborted))
    return SlotOutcome(slot, episode_id_for(plan.group_id, slot, MAX_ATTEMPTS - 1), "aborted",
                       None, False, tuple(aborted))


async def aplay_remote_group(*, log: GroupLog, credentials: EpisodeCredentials, run_id: str,
                             task: Task, config: RunConfig, policy_version: int,
                             settings: Settings, group_index: int = 0,
                             gate: asyncio.Semaphore | None = None) -> GroupResult:
    """Play the group of ``task`` at ``policy_version`` through the run's RolloutServer
    (module docstring): ``config.group_size`` rollouts, recorded in ``log``, their
    credentials minted and revoked by ``credentials`` (the database's, or the API's). Raises
    ValueError when the run names no remote agent or ``remote_agent_store_url`` is not set;
    ``TransientError`` when the log or ``credentials`` cannot be reached; failures of the
    server end episodes ``error`` and do not raise."""
    agent = config.remote_agent
    if agent is None:
        raise ValueError(f"run {run_id!r} names no remote_agent")
    if not settings.remote_agent_store_url:
        raise ValueError("remote_agent_store_url (TRAJSTORE_REMOTE_AGENT_STORE_URL) is not "
                         "set: the RolloutServer needs this store's URL as its server_url")
    group_id = group_id_for(run_id, task.task_id, policy_version, group_index)
    async with httpx.AsyncClient(trust_env=False) as client:
        protocol: str = agent.protocol
        detect_error: str | None = None
        if protocol == "auto":
            try:
                protocol = await detect_protocol(client, agent.url)
            except RemoteAgentError as exc:
                detect_error = str(exc)
        plan = _Plan(log=log, credentials=credentials, run_id=run_id, task=task,
                     group_id=group_id, agent=agent, protocol=protocol, config=config,
                     policy_version=policy_version,
                     seed_root=seed_root(config, group_id, task.task_id, policy_version,
                                         group_index),
                     store_url=settings.remote_agent_store_url.rstrip("/"),
                     tokenizer_name=agent.tokenizer_name or config.tokenizer_name,
                     client=client, gate=gate, run_gate=_gate_of(run_id, agent.max_in_flight),
                     settings=settings)
        if detect_error is not None:
            slots = await asyncio.gather(*(_fail_slot(plan, slot, detect_error)
                                           for slot in range(config.group_size)))
        else:
            slots = await asyncio.gather(*(_play_slot(plan, slot)
                                           for slot in range(config.group_size)))
    return GroupResult(run_id, task.task_id, group_id, policy_version, tuple(slots))


async def _fail_slot(plan: _Plan, slot: int, reason: str) -> SlotOutcome:
    """A slot whose server could not be probed: started and ended ``error`` with the reason
    (a finished slot is left as it is)."""
    episode_id = episode_id_for(plan.group_id, slot)
    state = await asyncio.to_thread(plan.log.stream_state, episode_id)
    if state.version > 0:
        return SlotOutcome(slot, episode_id, state.status, state.reward, False)
    await asyncio.to_thread(plan.log.append, episode_id, [EpisodeStarted(
        event_id=_event_id(episode_id, "started"), occurred_at=dt.datetime.now(dt.UTC),
        run_id=plan.run_id, group_id=plan.group_id, task_id=plan.task.task_id,
        messages=[dict(m) for m in plan.task.messages],
        tools=[dict(t) for t in plan.task.tools], policy_version=plan.policy_version)], 0)
    await _finish(plan, episode_id, "error", reason, Reward(0.0, {}, source="error"))
    return SlotOutcome(slot, episode_id, "error", 0.0, True)
