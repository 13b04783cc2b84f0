"""Remote rollout (TrainGate protocol), beside the completions it drives:

- ``POST /v1/rollout/completed``: a RolloutServer reports that a rollout ended; the episode
  (``rollout_id``) gets its reward (when the report carries one) and ``episode_finished``.
  Event ids are derived from the rollout id, so a retried report is stored once.
- ``POST /rollout``: this process as the RolloutServer: it drives the agent loop of one
  rollout, calling back the trainer at ``server_url`` (``/v1/chat/completions``, else
  ``/v1/completions``: ``workers.rollout.remote.run_remote_rollout``).
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
from api.schemas.remote import RolloutCompleted, RolloutCompletedAck, RolloutRequest
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
