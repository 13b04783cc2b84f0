"""Episodes: start one, append batches of events, list with filters, read one with its
events, and its merged timelines."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Query, Response

from api.cursor import decode_cursor, encode_cursor
from api.deps import Ctx, IngestKey, ReadKey
from api.errors import ERROR_RESPONSES, ApiError
from api.ingest import EPISODE_TYPES, append_batch
from api.schemas.episodes import (
    AppendRequest,
    AppendResult,
    BranchCreate,
    BranchQueued,
    EpisodeCreate,
    EpisodeCreated,
    EpisodeDetail,
    EpisodePage,
    EpisodeStatus,
    EpisodeSummary,
    EpisodeTimelines,
    FinishIn,
    RewardIn,
)
from api.timelines import episode_timelines
from api.tokens import Encoding, encode_array
from store import errors as store_errors
from store import queries
from store.codec import ID_DTYPE, LOGPROB_DTYPE
from store.eventlog import NO_STREAM, RecordedEvent
from store.events import EVENT_TYPES, EpisodeFinished, EpisodeStarted, RewardAssigned

__all__ = ["router"]

router = APIRouter(tags=["episodes"], responses=ERROR_RESPONSES)

_CONFLICT = ERROR_RESPONSES[422] | {
    "description": "Stale expected_version (`current_version` in the body) or an event id "
                   "stored before with other content."}


@router.post("/v1/runs/{run_id}/episodes", status_code=201, response_model=EpisodeCreated,
             responses={200: {"model": EpisodeCreated, "description": "A retried start."},
                        409: _CONFLICT})
def start_episode(run_id: str, body: EpisodeCreate, key: IngestKey, ctx: Ctx,
                  response: Response) -> EpisodeCreated:
    """Start an episode of the run: appends its ``episode_started``."""
    ctx.access.check_run(key, run_id)
    episode_id = body.episode_id or f"ep-{uuid.uuid4().hex}"
    event = EpisodeStarted(
        run_id=run_id, group_id=body.group_id, task_id=body.task_id, messages=body.messages,
        tools=body.tools, sampling_params=body.sampling_params,
        policy_version=body.policy_version, event_id=body.event_id)
    try:
        result = ctx.store.append(episode_id, [event], NO_STREAM)
    except store_errors.ConflictError:
        raise ApiError(409, "already_exists", f"episode {episode_id!r} exists already",
                       current_version=ctx.store.stream_version(episode_id)) from None
    if result.duplicate:
        response.status_code = 200
    return EpisodeCreated(episode_id=episode_id, run_id=run_id, group_id=body.group_id,
                          version=result.version, position=result.positions[0],
                          duplicate=result.duplicate)


def _opening_run(events: list[dict[str, Any]]) -> str | None:
    """The run named by the ``episode_started`` a batch opens with, if it does."""
    first = events[0] if events else None
    if isinstance(first, dict) and first.get("type") == "episode_started":
        run_id = first.get("run_id")
        if isinstance(run_id, str) and run_id:
            return run_id
    return None


@router.post("/v1/episodes/{episode_id}/events", response_model=AppendResult,
             responses={409: _CONFLICT})
def append_events(episode_id: str, body: AppendRequest, key: IngestKey, ctx: Ctx
                  ) -> AppendResult:
    """Append a batch of events to an episode, all or nothing (see ``AppendRequest``).
    A batch that opens a new episode starts with its ``episode_started``."""
    opening = _opening_run(body.events)
    if opening is not None and body.expected_version in (0, "no_stream"):
        # A batch opening a new stream: the run it names decides the project. Should the
        # stream exist, the store refuses the batch (or, for a faithful retry, answers with
        # the stored positions: the same batch, so the same run).
        ctx.access.check_run(key, opening)
        try:
            result = append_batch(ctx.store, episode_id, body.events,
                                  expected_version=body.expected_version,
                                  allowed=EPISODE_TYPES)
        except (store_errors.ConflictError, store_errors.IdempotencyError):
            ctx.access.check_episode(key, episode_id)  # 403 for another project's stream
            raise
    else:
        try:
            ctx.access.check_episode(key, episode_id)
        except ApiError as exc:
            if exc.status != 404:
                raise
            raise ApiError(404, "not_found", f"no episode {episode_id!r}; start it first "
                           "(POST /v1/runs/{run_id}/episodes) or open the batch with its "
                           "episode_started and expected_version \"no_stream\"") from None
        result = append_batch(ctx.store, episode_id, body.events,
                              expected_version=body.expected_version, allowed=EPISODE_TYPES)
    return AppendResult(stream_id=episode_id, version=result.version,
                        positions=list(result.positions), duplicate=result.duplicate)


def _open_episode(ctx: Any, key: Any, episode_id: str) -> int:
    """The episode's stream version after the project check; ApiError 409 when finished."""
    ctx.access.check_episode(key, episode_id)
    if queries.episode_finished(ctx.store, episode_id):
        raise ApiError(409, "episode_finished", f"episode {episode_id!r} is finished")
    return ctx.store.stream_version(episode_id)


@router.post("/v1/episodes/{episode_id}/reward", response_model=AppendResult,
             responses={409: ERROR_RESPONSES[422] | {
                 "description": "The episode is finished and some of its samples were "
                                "consumed (`samples_consumed`) or are leased "
                                "(`samples_leased`); `samples` names them."}})
def reward_episode(episode_id: str, body: RewardIn, key: IngestKey, ctx: Ctx) -> AppendResult:
    """Record a reward (``reward_assigned``), before or after the episode finished. The
    latest reward is the episode's; every one stays in the log. A late one (after
    ``episode_finished``) is taken as long as no sample of the episode was consumed or is
    leased (409 ``samples_consumed``/``samples_leased`` naming them): the episode is
    replayed with it and its samples become ready. A retry with the same ``event_id``
    stores it once. Bad input: a value that is not a finite number (a boolean or a string
    included) is 422 naming the field; an unknown episode is 404; another project's, 403.
    Nothing is stored then."""
    ctx.access.check_episode(key, episode_id)
    event = RewardAssigned(value=body.value, components=body.components, source=body.source,
                           event_id=body.event_id or None)
    result = ctx.store.append(episode_id, [event])
    return AppendResult(stream_id=episode_id, version=result.version,
                        positions=list(result.positions), duplicate=result.duplicate)


@router.post("/v1/episodes/{episode_id}/finish", response_model=AppendResult)
def finish_episode(episode_id: str, body: FinishIn, key: IngestKey, ctx: Ctx) -> AppendResult:
    """Finish the episode (``episode_finished``, after ``reward_assigned`` when ``reward`` is
    given). Idempotent: finishing a finished episode stores nothing and answers with its
    version and ``duplicate`` true."""
    try:
        version = _open_episode(ctx, key, episode_id)
    except ApiError as exc:
        if exc.status != 409:
            raise
        return AppendResult(stream_id=episode_id, version=ctx.store.stream_version(episode_id),
                            positions=[], duplicate=True)
    events: list[Any] = []
    if body.reward is not None:
        events.append(RewardAssigned(value=body.reward, source="client"))
    events.append(EpisodeFinished(status=body.status, reason=body.reason))
    try:
        result = ctx.store.append(episode_id, events, version)
    except store_errors.ConflictError:
        if queries.episode_finished(ctx.store, episode_id):  # a concurrent finish won
            return AppendResult(stream_id=episode_id,
                                version=ctx.store.stream_version(episode_id), positions=[],
                                duplicate=True)
        raise
    return AppendResult(stream_id=episode_id, version=result.version,
                        positions=list(result.positions), duplicate=False)


@router.get("/v1/episodes", response_model=EpisodePage)
def list_episodes(
    key: ReadKey,
    ctx: Ctx,
    run_id: str | None = None,
    group_id: str | None = None,
    status: EpisodeStatus | None = None,
    reward_min: Annotated[float | None, Query(allow_inf_nan=False)] = None,
    reward_max: Annotated[float | None, Query(allow_inf_nan=False)] = None,
    policy_version: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
    error_type: str | None = None,
    tool_name: str | None = None,
    branched_from: str | None = None,
    started_after: dt.datetime | None = None,
    started_before: dt.datetime | None = None,
    limit: Annotated[int | None, Query(ge=1)] = None,
    cursor: str | None = None,
) -> EpisodePage:
    """Episodes of the key's project (or one run), in start order, filtered, one page at a
    time: pass ``next_cursor`` back as ``cursor`` for the next page."""
    if run_id is not None:
        ctx.access.check_run(key, run_id)
        runs = [run_id]
    else:
        runs = queries.run_ids_of(ctx.store, key.project)
    size = min(limit or ctx.settings.api_page_size, ctx.settings.api_max_page_size)
    filters = queries.EpisodeFilters(
        run_ids=runs, group_id=group_id, status=status, reward_min=reward_min,
        reward_max=reward_max, policy_version=policy_version, error_type=error_type,
        tool_name=tool_name, started_after=started_after, started_before=started_before,
        branched_from=branched_from)
    rows = queries.list_episodes(ctx.store, filters, after=decode_cursor(cursor),
                                 limit=size + 1)
    more = len(rows) > size
    rows = rows[:size]
    return EpisodePage(
        episodes=[EpisodeSummary.model_validate(r) for r in rows],
        next_cursor=encode_cursor(rows[-1]["position"]) if more and rows else None)


def _event_out(r: RecordedEvent, *, tokens: bool, encoding: Encoding) -> dict[str, Any]:
    event = r.event
    out: dict[str, Any] = {
        "position": r.position, "stream_version": r.stream_version, "type": r.type,
        "event_id": str(event.event_id), "occurred_at": event.occurred_at,
        "recorded_at": r.recorded_at, "data": event.to_data(),
    }
    payloads = event.token_payloads()
    if tokens and payloads:
        out["tokens"] = {
            name: encode_array(arr, dtype=LOGPROB_DTYPE if name == "logprobs" else ID_DTYPE,
                               encoding=encoding)
            for name, arr in payloads.items()
        }
    return out


def _current(row: dict[str, Any]) -> bool:
    cls = EVENT_TYPES.get(row["type"])
    return cls is not None and row["schema_version"] == cls.schema_version


def _row_out(row: dict[str, Any]) -> dict[str, Any]:
    """An event read without its tokens (its data as stored: the current schema)."""
    return {"position": row["position"], "stream_version": row["stream_version"],
            "type": row["type"], "event_id": str(row["event_id"]),
            "occurred_at": row["occurred_at"], "recorded_at": row["recorded_at"],
            "data": row["data"], "tokens": None}


@router.get("/v1/episodes/{episode_id}", response_model=EpisodeDetail)
def get_episode(episode_id: str, key: ReadKey, ctx: Ctx, tokens: bool = True,
                encoding: Encoding = "json") -> EpisodeDetail:
    """One episode: its summary and every event (token payloads unless ``tokens=false``)."""
    ctx.access.check_episode(key, episode_id)
    row = queries.episode_row(ctx.store, episode_id)
    if row is None:  # pragma: no cover - check_episode found it a moment ago
        raise ApiError(404, "not_found", f"no episode {episode_id!r}")
    if tokens:
        events = [_event_out(r, tokens=True, encoding=encoding)
                  for r in ctx.store.read_stream(episode_id)]
    else:
        rows = queries.stream_event_rows(ctx.store, episode_id)
        if all(_current(r) for r in rows):
            events = [_row_out(r) for r in rows]
        else:  # data stored under an older schema version: read it upcast
            events = [_event_out(r, tokens=False, encoding=encoding)
                      for r in ctx.store.read_stream(episode_id)]
    return EpisodeDetail.model_validate({"summary": row, "events": events})


@router.get("/v1/episodes/{episode_id}/timelines", response_model=EpisodeTimelines,
            responses={409: ERROR_RESPONSES[422] | {
                "description": "The episode cannot be replayed (reason in the message)."}})
def get_timelines(episode_id: str, key: ReadKey, ctx: Ctx, encoding: Encoding = "json"
                  ) -> EpisodeTimelines:
    """The episode's merged timelines with per-token loss mask and rollout logprobs, its
    negative samples and fork points, replayed now with the run's tokenizer."""
    ctx.access.check_episode(key, episode_id)
    return EpisodeTimelines.model_validate(
        episode_timelines(ctx.store, episode_id, encoding=encoding))



@router.post("/v1/episodes/{episode_id}/branches", status_code=202, response_model=BranchQueued,
             responses={429: {"description": "The project has "
                                             "TRAJSTORE_ROLLOUT_PROJECT_QUEUED rollouts "
                                             "queued or running."},
                        503: {"description": "The broker cannot be reached."}})
def branch_episode(episode_id: str, body: BranchCreate, key: IngestKey, ctx: Ctx
                   ) -> BranchQueued:
    """Start ``n`` new episodes (default: the run's group size) from a recorded ``turn`` (LLM
    calls kept, 0 to the episode's number of calls) or ``checkpoint`` of the episode: they keep
    its prefix as recorded and generate new continuations, played by a rollout worker
    (``trajstore.branch_episode`` on the rollout queue); their ``episode_started`` records
    ``branched_from``. Answers 202 with the group and the episode ids it will hold. An unknown
    episode, turn or checkpoint: 404 naming it; ``n`` out of [1, 256], a negative turn, both
    or neither of turn and checkpoint: 422 naming the field; another project's episode: 403;
    the project's rollouts queued or running at ``TRAJSTORE_ROLLOUT_PROJECT_QUEUED``: 429
    naming it."""
    from workers.rollout.branch_point import (
        BranchNotFound,
        branch_episode_ids,
        branch_group_id,
        branch_point,
        send_branch,
    )
    from workers.rollout.fair import RolloutBudgetExceeded

    ctx.access.check_episode(key, episode_id)
    if (body.turn is None) == (body.checkpoint is None):
        raise ApiError(422, "invalid_request", "give exactly one of turn and checkpoint",
                       field="body.turn")
    events = [r.event for r in queries.get_episode(ctx.store, episode_id)]
    try:
        point = branch_point(episode_id, events, turn=body.turn, checkpoint=body.checkpoint)
    except BranchNotFound as exc:
        raise ApiError(404, "not_found", str(exc),
                       field="body.turn" if body.turn is not None else "body.checkpoint"
                       ) from None
    except ValueError as exc:
        raise ApiError(422, "invalid_request", str(exc), field="path.episode_id") from None
    run_id = point.started.run_id
    n = body.n if body.n is not None else ctx.store.get_run(run_id).config.group_size
    group_id = branch_group_id(episode_id, point.turn, point.checkpoint, body.group_index)
    try:
        send_branch(ctx.settings, episode_id=episode_id, turn=body.turn,
                    checkpoint=body.checkpoint, n=n, group_index=body.group_index,
                    project=key.project)
    except RolloutBudgetExceeded as exc:
        raise ApiError(429, "too_many_requests", str(exc), headers={"Retry-After": "5"},
                       limit=exc.limit) from None
    except ConnectionError as exc:
        raise ApiError(503, "unavailable", f"{exc}; retry later") from None
    return BranchQueued(parent=episode_id, run_id=run_id, turn=point.turn,
                        checkpoint=point.checkpoint, group_id=group_id,
                        episode_ids=branch_episode_ids(group_id, n))
