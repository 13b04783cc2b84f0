"""Remote rollout (TrainGate protocol), beside the completions it drives:

- ``POST /v1/rollout/completed``: a RolloutServer reports that a rollout ended; the episode
  (``rollout_id``) gets its reward (when the report carries one) and ``episode_finished``.
  Event ids are derived from the rollout id, so a retried report is stored once; a report
  with a reward for an episode finished already records it as a late reward.
- ``POST /rollout``: this store as the RolloutServer: the request is checked here, then
  queued on the rollout queue; a rollout worker drives the agent loop, calling back the
  trainer at ``server_url`` (``/v1/chat/completions``, else ``/v1/completions``), and pushes
  the RolloutResponse back to this request, which waits for it up to
  ``TRAJSTORE_ROLLOUT_WAIT_S`` (``workers.rollout.remote_dispatch``). The wait is awaited on
  the event loop, holding no worker thread, and at most
  ``TRAJSTORE_ROLLOUT_WAITING_PER_PROJECT`` of a project's rollouts wait at once (429).
- ``GET /tools``: the tools a rollout offers (the server's, a run's), as the reference
  RolloutServer lists them (``{"tools": [...]}``).
- ``POST /v1/rollout/init``: the same as the asynchronous revision's RolloutServer: checked
  and queued the same way, answered 202 with the tools at once; the rollout worker plays it
  and posts the RolloutResponse to the trainer's ``/v1/rollout/completed``.

No agent loop runs in this process: a request is checked with
``workers.rollout.remote_request`` and handed to a worker of the rollout queue
(``trajstore worker --queues rollout``, which ``trajstore up`` runs).
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any, Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from api.deps import AnyKey, Ctx, IngestKey
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
from store.arguments import real_number
from store.eventlog import ANY, NO_STREAM
from store.events import EpisodeFinished, Event, RewardAssigned
from workers.engines.tokenizers import allowed_roots, tokenizer_root_problem
from workers.rollout.fair import RolloutBudgetExceeded, send_remote_budgeted
from workers.rollout.remote_dispatch import (
    await_answer,
    claim_rollout,
    release_rollout,
    release_waiting,
    reserve_waiting,
)
from workers.rollout.remote_request import (
    DEFAULT_REMOTE_RUN_ID,
    TokenizerMismatchError,
    check_run_tokenizer,
    check_trainer_host,
    parse_rollout_request,
    remote_episode_id,
    resolve_tokenizer,
)
from workers.rollout.user_tools import offered_tools

__all__ = ["router", "completion_events"]

router = APIRouter(tags=["remote rollout"], responses=ERROR_RESPONSES)

_NAMESPACE = uuid.UUID("6f1f3f5e-3c0e-4d5e-9a57-1c7a1b2d9e10")
_TRUNCATED = ("max_turns", "max_tokens", "length")


def _number(value: Any, where: str) -> float | None:
    """A finite number (``store.arguments.real_number``) as a float; None for anything
    else, except a boolean: ApiError 422 naming ``where`` (``true`` is not a reward of 1)."""
    if isinstance(value, bool):
        raise ApiError(422, "invalid_request", f"{where} must be a finite number, not a "
                       f"boolean, got {value!r}", field=f"body.{where}")
    try:
        return real_number(where, value)
    except ValueError:
        return None


def _reward(body: RolloutCompleted) -> float | None:
    """The reward a completion report carries, wherever the protocol's revisions put it:
    ``reward``, ``reward_score``, ``extra_fields.reward``, ``extra_fields.reward_score``,
    ``extra_fields.reward_extra_info.reward``, ``metrics.reward`` (the first that is a finite
    number). A boolean in any of these places is refused (ApiError 422 naming it)."""
    if body.reward is not None:
        return float(body.reward)
    extra = body.extra_fields or {}
    info = extra.get("reward_extra_info")
    candidates = [("reward_score", (body.model_extra or {}).get("reward_score")),
                  ("extra_fields.reward", extra.get("reward")),
                  ("extra_fields.reward_score", extra.get("reward_score")),
                  ("extra_fields.reward_extra_info.reward",
                   info.get("reward") if isinstance(info, dict) else None),
                  ("metrics.reward", (body.metrics or {}).get("reward"))]
    numbers = [_number(value, where) for where, value in candidates]
    return next((v for v in numbers if v is not None), None)


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
        # The id names the rollout and the value: a retried report is stored once, and a
        # later report with another reward is a reward of its own (the latest is the one).
        events.append(RewardAssigned(
            event_id=uuid.uuid5(_NAMESPACE, f"{body.rollout_id}/reward/{reward!r}"),
            value=reward, source="rollout_server"))
    events.append(EpisodeFinished(
        event_id=uuid.uuid5(_NAMESPACE, f"{body.rollout_id}/finished"), status=status,
        reason=body.error_message or body.finish_reason))
    return events, status, reward


@router.post("/v1/rollout/completed", response_model=RolloutCompletedAck,
             responses={409: {"model": ErrorBody, "description": "The episode was finished "
                                                                 "otherwise and the report "
                                                                 "carries no reward, or its "
                                                                 "samples were consumed or "
                                                                 "are leased."}})
def rollout_completed(body: RolloutCompleted, key: IngestKey, ctx: Ctx) -> RolloutCompletedAck:
    """Record the end of a remote rollout: reward (if given) and ``episode_finished``.

    A report for an episode finished already (by an earlier report without a reward, as the
    asynchronous revision sends them, or by the idle sweep) records only its reward, as a
    late reward: taken while none of the episode's samples was consumed or is leased (409
    ``samples_consumed``/``samples_leased`` naming them otherwise), the episode keeps the
    status it finished with, and the answer says so. A faithful retry of a report is stored
    once; a report without a reward for an episode finished otherwise is 409
    ``episode_finished``. A value the store refuses (NUL, a lone surrogate, …) is answered
    422 naming it; a reward that is not a finite number (a boolean included) too."""
    refuse_unstorable(body)
    ctx.access.check_scope(key, body.rollout_id)
    ctx.access.check_episode(key, body.rollout_id)
    events, status, reward = completion_events(body)
    if not queries.episode_finished(ctx.store, body.rollout_id):
        try:
            result = ctx.store.append(body.rollout_id, events, ANY)
        except store_errors.ClosedError:  # a concurrent finish: this report came late
            pass
        else:
            return RolloutCompletedAck(rollout_id=body.rollout_id, status=status,
                                       reward=reward, version=result.version,
                                       duplicate=result.duplicate)
    recorded = (queries.episode_row(ctx.store, body.rollout_id) or {}).get("status") or status
    try:
        # A faithful retry of the report that finished the episode passes (the store answers
        # a retry before looking at the version); anything else conflicts with NO_STREAM, or
        # mixes a new reward with the stored finish.
        result = ctx.store.append(body.rollout_id, events, NO_STREAM)
    except (store_errors.ConflictError, store_errors.ValidationError):
        if reward is None:
            raise ApiError(409, "episode_finished", f"episode {body.rollout_id!r} was "
                           "finished before this report, which carries no reward") from None
        result = ctx.store.append(body.rollout_id, events[:1], ANY)  # a late reward
    return RolloutCompletedAck(rollout_id=body.rollout_id, status=recorded, reward=reward,
                               version=result.version, duplicate=result.duplicate)


#: The asynchronous revision's names for the fields ``parse_rollout_request`` names.
_INIT_NAMES = {"sampling_params": "completion_params", "callback_api_key": "api_key"}


def _request_error(exc: ValueError, fields: Any, names: dict[str, str]) -> ApiError:
    """422 for a request the rollout checks refused: the message in the revision's own field
    names (``names``: ours to theirs), ``field`` the first of ``fields`` it names."""
    message = str(exc)
    for ours, theirs in names.items():
        message = message.replace(f"'{ours}", f"'{theirs}")
    if isinstance(exc, TokenizerMismatchError):
        return ApiError(422, "tokenizer_mismatch", message, field="body.tokenizer_name")
    field = next((f"body.{name}" for name in fields if f"'{name}" in message), None)
    return ApiError(422, "invalid_request", message, field=field)


def run_tools(ctx: Ctx, run_id: str | None, tool_server_url: str | None = None
              ) -> list[dict[str, Any]]:
    """The schemas of the tools a rollout of ``run_id`` offers (the server's, the run's, and
    the MCP server ``tool_server_url``): ValueError naming the source that cannot be loaded
    or the name two sources give."""
    config = ctx.store.get_run(run_id).config.rollout if run_id else None
    if tool_server_url:
        check_trainer_host(tool_server_url, ctx.settings, field="tool_server_url")
    return offered_tools(ctx.settings, modules=config.tool_modules if config else (),
                         mcp_servers=config.mcp_servers if config else (),
                         tool_server_url=tool_server_url).schemas()


def _check(request: dict[str, Any], ctx: Ctx, *, run_id: str, fields: Any,
           names: dict[str, str] | None = None) -> tuple[str, list[dict[str, Any]]]:
    """Check a RolloutRequest dict before anything is queued (422 naming the field: its
    fields, the trainer host, the tokenizer and that it replays as the run's, the tools);
    returns the rollout id and the schemas of the tools it offers."""
    run_tokenizer = ctx.store.get_run(run_id).config.tokenizer_name
    try:
        parsed = parse_rollout_request(request)
        check_trainer_host(parsed.server_url, ctx.settings)
        outside = tokenizer_root_problem(parsed.tokenizer_name, allowed_roots(ctx.settings))
        if outside is not None:  # nothing outside the roots is looked at, let alone loaded
            raise ValueError(f"rollout request field 'tokenizer_name': {outside}")
        resolve_tokenizer(parsed.tokenizer_name, settings=ctx.settings)
        check_run_tokenizer(run_id, run_tokenizer, parsed.tokenizer_name)
    except ValueError as exc:
        raise _request_error(exc, fields, names or {}) from None
    try:
        tools = run_tools(ctx, run_id, parsed.tool_server_url)
    except ValueError as exc:
        field = "body.tool_server_url" if parsed.tool_server_url and (
            parsed.tool_server_url in str(exc) or "tool_server_url" in str(exc)) else "body.run_id"
        raise ApiError(422, "invalid_tools", f"the tools of this rollout: {exc}",
                       field=field) from None
    return parsed.rollout_id, tools


def _queue(request: dict[str, Any], ctx: Ctx, *, answer: bool, project: str) -> None:
    """Send the checked ``request`` to the rollout queue (claimed by the caller) within
    ``project``'s rollout budget; 429 naming the setting over it, 503 when the broker cannot
    be reached (the claim given back either way)."""
    try:
        send_remote_budgeted(request, ctx.settings, answer=answer, project=project)
    except RolloutBudgetExceeded as exc:
        with contextlib.suppress(ConnectionError):
            release_rollout(ctx.settings, str(request["rollout_id"]))
        raise ApiError(429, "too_many_requests", str(exc), headers={"Retry-After": "5"},
                       limit=exc.limit) from None
    except ConnectionError as exc:
        with contextlib.suppress(ConnectionError):  # the claim expires on its own too
            release_rollout(ctx.settings, str(request["rollout_id"]))
        raise ApiError(503, "unavailable", f"{exc}; retry later") from None


def _claim(ctx: Ctx, rollout_id: str) -> bool:
    try:
        return claim_rollout(ctx.settings, rollout_id)
    except ConnectionError as exc:
        raise ApiError(503, "unavailable", f"{exc}; retry later") from None


@router.post("/rollout", responses={
    200: {"description": "The RolloutResponse: rollout_id, status, final_messages, "
                         "finish_reason, error_message, metrics, episode_id."},
    409: {"model": ErrorBody, "description": "This rollout_id was recorded or queued "
                                             "before."},
    429: {"model": ErrorBody, "description": "The project has "
                                             "TRAJSTORE_ROLLOUT_WAITING_PER_PROJECT "
                                             "rollouts waiting already, or "
                                             "TRAJSTORE_ROLLOUT_PROJECT_QUEUED "
                                             "rollouts queued or running."},
    503: {"model": ErrorBody, "description": "The broker cannot be reached."},
    504: {"model": ErrorBody, "description": "No rollout worker answered within "
                                             "TRAJSTORE_ROLLOUT_WAIT_S."}})
async def rollout(body: RolloutRequest, key: IngestKey, ctx: Ctx) -> JSONResponse:
    """Drive one remote rollout as the RolloutServer (the seed's ``RolloutRequest``),
    recording it as episode ``rollout-<rollout_id>`` of ``run_id``: checked here, played by
    a worker of the rollout queue, answered with its RolloutResponse. The answer is awaited
    on the event loop: a waiting rollout holds no worker thread, and a project has at most
    ``TRAJSTORE_ROLLOUT_WAITING_PER_PROJECT`` waiting at once (one more: 429 naming the
    setting, nothing queued). Bad input, checked before anything is queued: a field of the
    wrong type or out of range, an unknown field, a value the store refuses, a trainer host
    that is not allowed, an unknown tokenizer: 422 naming the field; a tokenizer that is not
    the run's vocabulary: 422 ``tokenizer_mismatch``; tools that cannot be loaded (a module
    that does not import, an MCP server that cannot be listed, a name two sources give): 422
    ``invalid_tools`` naming them; another project's run: 403; an unknown run: 404; a
    rollout id recorded or queued before: 409; the project's rollouts queued or
    running at ``TRAJSTORE_ROLLOUT_PROJECT_QUEUED``: 429 naming it. No worker answering within
    ``TRAJSTORE_ROLLOUT_WAIT_S``: 504 naming the rollout id (the rollout may still be played
    later)."""
    settings = ctx.settings
    request, rollout_id, episode_id = await run_in_threadpool(_check_rollout, body, key, ctx)
    limit = settings.rollout_waiting_per_project
    try:
        waiting = await reserve_waiting(settings, key.project, limit=limit)
    except ConnectionError as exc:
        raise ApiError(503, "unavailable", f"{exc}; retry later") from None
    if waiting is None:
        raise ApiError(429, "too_many_waiting", f"project {key.project!r} has {limit} "
                       f"synchronous rollouts waiting for their answer already "
                       f"(TRAJSTORE_ROLLOUT_WAITING_PER_PROJECT={limit}); retry when one has "
                       f"answered, or start rollouts with POST /v1/rollout/init")
    try:
        await run_in_threadpool(_claim_and_queue, request, ctx, rollout_id, episode_id,
                                key.project)
        wait = settings.rollout_wait_s
        try:
            answer = await await_answer(settings, rollout_id, timeout_s=wait)
        except ConnectionError as exc:
            raise ApiError(503, "unavailable", f"rollout {rollout_id!r} was queued, but "
                           f"{exc}") from None
    finally:
        with contextlib.suppress(ConnectionError):
            await release_waiting(settings, key.project)
    if answer is None:
        raise ApiError(504, "timeout", f"rollout {rollout_id!r}: no rollout worker answered "
                       f"within {wait:g} s (TRAJSTORE_ROLLOUT_WAIT_S; is a worker of the "
                       f"rollout queue running?); it may still be played as episode "
                       f"{episode_id!r}")
    if answer.status != 200:
        raise ApiError(answer.status, answer.code or "rollout_failed",
                       answer.message or f"rollout {rollout_id!r} failed")
    return JSONResponse(answer.body)


def _check_rollout(body: RolloutRequest, key: Any, ctx: Ctx
                   ) -> tuple[dict[str, Any], str, str]:
    """The checks of ``POST /rollout`` that read the store (run in a pool thread, briefly):
    the request dict, its rollout id and episode id."""
    refuse_unstorable(body)
    run_id = body.run_id or DEFAULT_REMOTE_RUN_ID
    ctx.access.check_run(key, run_id)
    request = body.model_dump(mode="json", exclude_none=True)
    rollout_id, _ = _check(request, ctx, run_id=run_id, fields=RolloutRequest.model_fields)
    episode_id = remote_episode_id(rollout_id)
    if ctx.store.stream_version(episode_id) != 0:
        raise _recorded(rollout_id, episode_id)
    return request, rollout_id, episode_id


def _recorded(rollout_id: str, episode_id: str) -> ApiError:
    return ApiError(409, "already_exists", f"rollout_id {rollout_id!r} was recorded "
                    f"(episode {episode_id!r}) or queued before")


def _claim_and_queue(request: dict[str, Any], ctx: Ctx, rollout_id: str,
                     episode_id: str, project: str) -> None:
    if not _claim(ctx, rollout_id):
        raise _recorded(rollout_id, episode_id)
    _queue(request, ctx, answer=True, project=project)


@router.get("/tools", responses={
    200: {"description": "The tools a rollout offers, as the reference RolloutServer lists "
                         "them: {\"tools\": [OpenAI function schemas]}."}})
def list_tools(key: AnyKey, ctx: Ctx, run_id: str | None = None) -> JSONResponse:
    """The tools a remote rollout offers the model, as the protocol's reference
    RolloutServer serves ``GET /tools``: the server's (``TRAJSTORE_ROLLOUT_TOOL_MODULES``,
    ``TRAJSTORE_ROLLOUT_MCP_SERVERS``; the calculator when it has none) and, with
    ``run_id``, the run's (``config.rollout.tool_modules``, ``config.rollout.mcp_servers``).
    Another project's run: 403; an unknown run: 404; tools that cannot be loaded: 422
    ``invalid_tools`` naming them."""
    if run_id is not None:
        ctx.access.check_run(key, run_id)
    try:
        return JSONResponse({"tools": run_tools(ctx, run_id)})
    except ValueError as exc:
        raise ApiError(422, "invalid_tools", str(exc),
                       field="query.run_id" if run_id else None) from None


@router.post("/v1/rollout/init", status_code=202, response_model=RolloutInitAccepted,
             responses={429: {"model": ErrorBody,
                              "description": "The project has "
                                             "TRAJSTORE_ROLLOUT_PROJECT_QUEUED rollouts "
                                             "queued or running."},
                        503: {"model": ErrorBody,
                              "description": "The broker cannot be reached."}})
def rollout_init(body: RolloutInitRequest, key: IngestKey, ctx: Ctx) -> RolloutInitAccepted:
    """Start one rollout of the protocol's asynchronous revision as the RolloutServer and
    answer 202 with the tools offered to the model; the rollout is queued on the rollout
    queue, played by a rollout worker against the trainer at ``server_url``, and its
    RolloutResponse posted to ``{server_url}/v1/rollout/completed`` (retried on network
    errors, 408, 425, 429 and 5xx). It is recorded as episode ``rollout-<rollout_id>`` of
    ``run_id`` (default ``remote``) and played with the run's tokenizer. A ``rollout_id``
    recorded or queued before is answered 202 again and not played twice. Bad input, checked
    before anything is queued: a field of the wrong type or out of range, an unknown field, a
    value the store refuses, a run that names no tokenizer or a trainer host that is not
    allowed: 422 naming the field; another project's run or rollout: 403; an unknown run:
    404; the project's rollouts queued or running at ``TRAJSTORE_ROLLOUT_PROJECT_QUEUED``: 429
    naming it; the broker unreachable: 503."""
    refuse_unstorable(body)
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
    _, tools = _check(request, ctx, run_id=run_id, fields=RolloutInitRequest.model_fields,
                      names=_INIT_NAMES)
    accepted = RolloutInitAccepted(rollout_id=body.rollout_id, tools=tools)
    episode_id = remote_episode_id(body.rollout_id)
    if ctx.store.stream_version(episode_id) != 0:
        ctx.access.check_episode(key, episode_id)  # recorded before: another project's?
        return accepted
    if _claim(ctx, body.rollout_id):
        _queue(request, ctx, answer=False, project=key.project)
    return accepted
