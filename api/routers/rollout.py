"""Remote rollout (TrainGate protocol), beside the completions it drives:

- ``POST /v1/rollout/completed``: a RolloutServer reports that a rollout ended; the episode
  (``rollout_id``) gets its reward (when the report carries one) and ``episode_finished``.
  Event ids are derived from the rollout id, so a retried report is stored once.
- ``POST /rollout``: this process as the RolloutServer: it drives the agent loop of one
  rollout, calling back the trainer at ``server_url`` (``/v1/chat/completions``, else
  ``/v1/completions``: ``workers.rollout.remote.run_remote_rollout``).
- ``POST /v1/rollout/init``: the same as the asynchronous revision's RolloutServer: answers
  202 with the tools at once, plays the rollout on a thread of this process and posts the
  RolloutResponse to the trainer's ``/v1/rollout/completed``
  (``workers.rollout.remote.play_and_report``). A thread, not a Celery task: the rollout
  waits on the trainer, not on this machine, and ``trajstore serve`` alone must serve it.
"""

from __future__ import annotations

import importlib
import math
import uuid
from typing import Any, Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from api.deps import Ctx, IngestKey
from api.errors import ERROR_RESPONSES, ApiError, refuse_unstorable
from api.schemas.common import ErrorBody
from api.schemas.remote import (
    RolloutCompleted,
    RolloutCompletedAck,
    RolloutInitAccepted,
    RolloutInitRequest,
    RolloutRequest,
)
from store import errors as store_errors
from store import queries
from store.eventlog import ANY, NO_STREAM
from store.events import EpisodeFinished, Event, RewardAssigned

__all__ = ["router", "completion_events"]

router = APIRouter(tags=["remote rollout"], responses=ERROR_RESPONSES)

_NAMESPACE = uuid.UUID("6f1f3f5e-3c0e-4d5e-9a57-1c7a1b2d9e10")
_TRUNCATED = ("max_turns", "max_tokens", "length")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _reward(body: RolloutCompleted) -> float | None:
    """The reward a completion report carries, wherever the protocol's revisions put it:
    ``reward``, ``reward_score``, ``extra_fields.reward``, ``extra_fields.reward_score``,
    ``extra_fields.reward_extra_info.reward``, ``metrics.reward`` (the first that is a finite
    number)."""
    if body.reward is not None:
        return float(body.reward)
    extra = body.extra_fields or {}
    info = extra.get("reward_extra_info")
    candidates = [(body.model_extra or {}).get("reward_score"), extra.get("reward"),
                  extra.get("reward_score"),
                  info.get("reward") if isinstance(info, dict) else None,
                  (body.metrics or {}).get("reward")]
    return next((v for v in map(_number, candidates) if v is not None), None)


def completion_events(body: RolloutCompleted) -> tuple[list[Event], str, float | None]:
    """The events a completion report becomes (reward, then episode_finished), the
    episode status and the reward. ``COMPLETED`` is ``completed`` (``truncated`` when the
    finish reason is a turn or token limit), ``ERROR`` is ``error``."""
    reward = _reward(body)
    status: Literal["completed", "truncated", "error"]
    if body.status == "ERROR":
        status = "error"
    elif body.finish_reason in _TRUNCATED:
        status = "truncated"
    else:
        status = "completed"
    events: list[Event] = []
    if reward is not None:
        events.append(RewardAssigned(
            event_id=uuid.uuid5(_NAMESPACE, f"{body.rollout_id}/reward"), value=reward,
            source="rollout_server"))
    events.append(EpisodeFinished(
        event_id=uuid.uuid5(_NAMESPACE, f"{body.rollout_id}/finished"), status=status,
        reason=body.error_message or body.finish_reason))
    return events, status, reward


@router.post("/v1/rollout/completed", response_model=RolloutCompletedAck,
             responses={409: {"model": ErrorBody, "description": "The episode was finished "
                                                                 "otherwise."}})
def rollout_completed(body: RolloutCompleted, key: IngestKey, ctx: Ctx) -> RolloutCompletedAck:
    """Record the end of a remote rollout: reward (if given) and ``episode_finished``.
    A value the store refuses (NUL, a lone surrogate, …) is answered 422 naming it."""
    refuse_unstorable(body)
    ctx.access.check_episode(key, body.rollout_id)
    events, status, reward = completion_events(body)
    finished = queries.episode_finished(ctx.store, body.rollout_id)
    try:
        # Already finished: only a faithful retry of this very report may pass (the store
        # answers a retry before looking at the version; anything else conflicts with
        # NO_STREAM, as the stream exists).
        result = ctx.store.append(body.rollout_id, events, NO_STREAM if finished else ANY)
    except store_errors.ConflictError:
        raise ApiError(409, "episode_finished", f"episode {body.rollout_id!r} was finished "
                       "before this report") from None
    return RolloutCompletedAck(rollout_id=body.rollout_id, status=status, reward=reward,
                               version=result.version, duplicate=result.duplicate)


def _check_tokenizer_name(ctx: Ctx, run_id: str, name: str) -> None:
    """The rollout is played with ``tokenizer_name`` (its ids are what the trainer answers)
    and replayed with the run's tokenizer: refuse (422 naming both) when the run names a
    tokenizer with another vocabulary, before anything runs. A run naming none is not
    checked (its episodes give samples once it names one)."""
    from workers.tokenizers import TokenizerNotFound, canonical_tokenizer, load_tokenizer

    config = ctx.store.get_run(run_id).config
    run_name = config.tokenizer_name
    if not run_name or canonical_tokenizer(run_name) == canonical_tokenizer(name):
        return
    where = "body.tokenizer_name"
    try:
        ours, theirs = load_tokenizer(run_name), load_tokenizer(name)
    except TokenizerNotFound as exc:
        raise ApiError(422, "invalid_request", f"tokenizer_name {name!r}: {exc}",
                       field=where) from None
    if ours is not theirs and ours.get_vocab() != theirs.get_vocab():
        raise ApiError(422, "tokenizer_mismatch",
                       f"tokenizer_name {name!r} is not run {run_id!r}'s tokenizer "
                       f"{run_name!r}: the rollout's token ids would replay as another "
                       "vocabulary's; use the run's tokenizer or a run of this one",
                       field=where)


def _remote_rollout() -> Any:
    try:
        module = importlib.import_module("workers.rollout.remote")
    except ModuleNotFoundError as exc:
        if exc.name in ("workers.rollout.remote",):
            return None
        raise
    return getattr(module, "run_remote_rollout", None)


@router.post("/rollout", responses={
    200: {"description": "The RolloutResponse: rollout_id, status, final_messages, "
                         "finish_reason, error_message, metrics, episode_id."},
    409: {"model": ErrorBody, "description": "This rollout_id was recorded before."},
    501: {"model": ErrorBody, "description": "This installation has no RolloutServer."}})
def rollout(body: RolloutRequest, key: IngestKey, ctx: Ctx) -> JSONResponse:
    """Drive one remote rollout as the RolloutServer (the seed's ``RolloutRequest``),
    recording it as episode ``rollout-<rollout_id>`` of ``run_id``. A value the store
    refuses (NUL, a lone surrogate, …) is answered 422 naming it before anything runs."""
    refuse_unstorable(body)
    run = _remote_rollout()
    if run is None:
        raise ApiError(501, "not_implemented", "this installation has no RolloutServer "
                       "(workers.rollout.remote.run_remote_rollout is missing)")
    from workers.rollout.remote import DEFAULT_REMOTE_RUN_ID, DuplicateRolloutError

    run_id = body.run_id or DEFAULT_REMOTE_RUN_ID
    ctx.access.check_run(key, run_id)
    _check_tokenizer_name(ctx, run_id, body.tokenizer_name)
    request = body.model_dump(mode="json", exclude_none=True)
    try:
        result = run(request, store=ctx.store, settings=ctx.settings)
    except DuplicateRolloutError as exc:
        raise ApiError(409, "already_exists", str(exc)) from None
    except ValueError as exc:
        raise ApiError(422, "invalid_request", str(exc)) from None
    return JSONResponse(result)


#: The asynchronous revision's names for the fields ``parse_rollout_request`` names.
_INIT_NAMES = {"sampling_params": "completion_params", "callback_api_key": "api_key"}


def _init_error(exc: ValueError) -> ApiError:
    message = str(exc)
    for ours, theirs in _INIT_NAMES.items():
        message = message.replace(f"'{ours}", f"'{theirs}")
    field = next((f"body.{name}" for name in RolloutInitRequest.model_fields
                  if f"'{name}" in message), None)
    return ApiError(422, "invalid_request", message, field=field)


@router.post("/v1/rollout/init", status_code=202, response_model=RolloutInitAccepted,
             responses={501: {"model": ErrorBody,
                              "description": "This installation has no RolloutServer."}})
def rollout_init(body: RolloutInitRequest, key: IngestKey, ctx: Ctx) -> RolloutInitAccepted:
    """Start one rollout of the protocol's asynchronous revision as the RolloutServer and
    answer 202 with the tools offered to the model; the rollout is played in the background
    against the trainer at ``server_url`` and its RolloutResponse posted to
    ``{server_url}/v1/rollout/completed`` (retried on network errors, 408, 425, 429 and
    5xx). It is recorded as episode ``rollout-<rollout_id>`` of ``run_id`` (default
    ``remote``) and played with the run's tokenizer. A ``rollout_id`` started before is
    answered 202 again and not played twice. Bad input, checked before anything starts: a
    field of the wrong type or out of range, an unknown field, a value the store refuses, a
    run that names no tokenizer or a trainer host that is not allowed: 422 naming the
    field; another project's run or rollout: 403; an unknown run: 404."""
    refuse_unstorable(body)
    if _remote_rollout() is None:
        raise ApiError(501, "not_implemented", "this installation has no RolloutServer "
                       "(workers.rollout.remote.run_remote_rollout is missing)")
    from workers.rollout.remote import (
        DEFAULT_REMOTE_RUN_ID,
        check_trainer_host,
        default_tools,
        parse_rollout_request,
        play_in_background,
        playing_in_background,
        remote_episode_id,
        resolve_tokenizer,
    )

    run_id = body.run_id or DEFAULT_REMOTE_RUN_ID
    ctx.access.check_run(key, run_id)
    tokenizer = ctx.store.get_run(run_id).config.tokenizer_name
    if not tokenizer:
        raise ApiError(422, "invalid_request", f"run {run_id!r} names no tokenizer: this "
                       "revision sends no tokenizer_name, so the rollout is played with the "
                       "run's; give the run a tokenizer or name a run that has one",
                       field="body.run_id")
    request: dict[str, Any] = {
        "rollout_id": body.rollout_id, "server_url": body.server_url,
        "messages": [m.model_dump(mode="json", exclude_none=True) for m in body.messages],
        "sampling_params": (body.completion_params.model_dump(mode="json", exclude_none=True)
                            if body.completion_params is not None else None),
        "tokenizer_name": tokenizer, "max_turns": body.max_turns,
        "max_tokens_total": body.max_tokens_total, "callback_api_key": body.api_key,
        "run_id": run_id, "group_id": body.group_id, "metadata": body.metadata,
        "tool_server_url": body.tool_server_url}
    request = {k: v for k, v in request.items() if v is not None}
    try:
        parsed = parse_rollout_request(request)
        check_trainer_host(parsed.server_url, ctx.settings)
        resolve_tokenizer(tokenizer, settings=ctx.settings)
    except ValueError as exc:
        raise _init_error(exc) from None
    tools = default_tools()
    accepted = RolloutInitAccepted(rollout_id=body.rollout_id, tools=tools.schemas())
    episode_id = remote_episode_id(body.rollout_id)
    if (not playing_in_background(body.rollout_id)
            and ctx.store.stream_version(episode_id) != 0):
        ctx.access.check_episode(key, episode_id)  # recorded before: another project's?
        return accepted
    try:
        play_in_background(request, store=ctx.store, settings=ctx.settings, tools=tools)
    except RuntimeError:  # no thread can be started (the process is at its limit)
        raise ApiError(503, "unavailable", "no thread is free to play this rollout; "
                       "retry later") from None
    return accepted
