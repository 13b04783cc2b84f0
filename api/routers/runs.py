"""Runs: create one (its configuration), list and read them, append to a run's own stream
(``policy_updated``), report and read which rollout engines serve which policy version
(``policy_served``, ``store.serving``). Appending ``policy_updated`` and reporting
``policy_served`` change what every trainer and engine of the run does: they need a
``train`` (or ``admin``) key."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import APIRouter, Response

from api.context import ApiContext
from api.deps import Ctx, IngestKey, ReadKey, TrainKey
from api.errors import ERROR_RESPONSES, ApiError
from api.ingest import append_batch
from api.schemas.episodes import AppendRequest, AppendResult
from api.schemas.runs import (
    EngineTakeupOut,
    PolicyServedIn,
    PolicyServedOut,
    PolicyTakeup,
    RunCreate,
    RunCreated,
    RunList,
    RunOut,
    VersionTakeupOut,
)
from store import errors as store_errors
from store import lineage, queries, serving
from store.eventlog import NO_STREAM, run_stream_id
from store.eventlog import AppendResult as StoreAppendResult
from store.events import RunCreated as RunCreatedEvent
from store.training_steps import exclusion_counts
from store.validation import check_text
from workers.engines.tokenizers import (
    allowed_roots,
    tokenizer_problem,
    tokenizer_root_problem,
)
from workers.rollout.remote_request import check_trainer_host
from workers.rollout.user_tools import offered_tools

__all__ = ["router", "run_out"]

router = APIRouter(prefix="/v1/runs", tags=["runs"], responses=ERROR_RESPONSES)


def run_summary(ctx: ApiContext, run_id: str) -> RunOut:
    """What the API and the web page show of one run that ``check_run`` has let through
    (its exclusions counted too)."""
    record = queries.run_record(ctx.store, run_id)
    if record is None:  # pragma: no cover - check_run found it a moment ago
        raise ApiError(404, "not_found", f"no run {run_id!r}")
    return run_out(ctx, record, excluded=True)


def run_out(ctx: ApiContext, record: dict[str, Any], *, excluded: bool = False) -> RunOut:
    """A run record (``queries.run_record`` / ``list_runs``) with its episode and sample
    counts and policy version: what the API and the web page show of a run. With
    ``excluded``, also what did not reach training per exclusion category (one query over
    the run's episodes: for one run, not for listings)."""
    data = record["data"]
    run_id = record["run_id"]
    return RunOut(
        run_id=run_id,
        project=data.get("project") or "default",
        config=data.get("config") or {},
        created_at=record["created_at"],
        version=record.get("version") or ctx.store.stream_version(run_stream_id(run_id)),
        episodes=queries.run_episode_counts(ctx.store, run_id),
        samples=ctx.leasing.stats(run_id),
        excluded=exclusion_counts(ctx.store.db, run_id) if excluded else {},
        policy_version=ctx.leasing.current_policy_version(run_id),
    )


@router.post("", status_code=201, response_model=RunCreated,
             responses={200: {"model": RunCreated, "description": "A retried create."},
                        409: ERROR_RESPONSES[422] | {"description": "The run exists."}})
def create_run(body: RunCreate, key: IngestKey, ctx: Ctx, response: Response) -> RunCreated:
    """Create a run with its configuration (appends ``run_created`` to the run's stream).
    The configuration is checked whole before anything is stored (``store.events.RunConfig``):
    an out-of-range value, a non-finite number, a chat template that does not parse, or
    settings that contradict each other (EGPO's sign conditions, the off-policy
    correction's) are refused with 422 naming the field, e.g. ``body.config.egpo.alpha``. A
    tokenizer replay could not load (``config.tokenizer``, else ``config.model``), or a
    folder outside the tokenizer roots (setting ``tokenizer_roots``), is refused with 422
    naming the accepted names and the setting (``workers.engines.tokenizers``), before
    anything is stored. A run that names neither is accepted: its episodes are stored and analysed,
    and replay records them as untrainable until a tokenizer is known."""
    project = body.project or key.project
    if project != key.project:
        raise ApiError(403, "forbidden", f"this key may create runs in project "
                                         f"{key.project!r} only, not {project!r}")
    named = body.config.tokenizer_name
    if named and check_text(named) is None:
        roots = allowed_roots(ctx.settings)
        problem = tokenizer_problem(named, roots=roots)
        if problem is not None:
            raise ApiError(422, "invalid", problem,
                           field="body.config.tokenizer" if body.config.tokenizer or not
                           body.config.model else "body.config.model",
                           refused_by_limit=tokenizer_root_problem(named, roots) is not None)
    _check_tools(body.config.rollout, ctx)
    event = RunCreatedEvent(run_id=body.run_id, project=project, config=body.config,
                            event_id=body.event_id)
    try:
        result = ctx.store.append(run_stream_id(body.run_id), [event], NO_STREAM)
    except store_errors.ConflictError:
        raise ApiError(409, "already_exists", f"run {body.run_id!r} exists already") from None
    if result.duplicate:
        response.status_code = 200
    return RunCreated(run_id=body.run_id, project=project, version=result.version,
                      position=result.positions[0], duplicate=result.duplicate)


@router.get("", response_model=RunList)
def list_runs(key: ReadKey, ctx: Ctx) -> RunList:
    """Every run of the key's project, oldest first."""
    return RunList(runs=[run_out(ctx, r) for r in queries.list_runs(ctx.store, key.project)])


@router.get("/{run_id}", response_model=RunOut)
def get_run(run_id: str, key: ReadKey, ctx: Ctx) -> RunOut:
    """A run: configuration, episode counts, sample counts by lease status, policy version."""
    ctx.access.check_run(key, run_id)
    return run_summary(ctx, run_id)


@router.post("/{run_id}/events", response_model=AppendResult,
             responses={409: ERROR_RESPONSES[422] | {"description": "Stale expected_version."}})
def append_run_events(run_id: str, body: AppendRequest, key: TrainKey, ctx: Ctx
                      ) -> AppendResult:
    """Append to the run's own stream (``policy_updated`` events; a ``train`` or ``admin``
    key). Each ``policy_updated`` must carry the run's newest policy version + 1 (the next
    in the batch one more), else 422 ``invalid_event`` naming ``version`` with
    ``expected_policy_version``; a faithful retry of a stored batch (same event ids) is
    answered as a retry. Its ``checkpoint``, when given, must lie under the checkpoint root
    (setting ``checkpoint_root``, else ``<data_dir>/checkpoints``; paths resolved before
    comparing, ``store.serving.checkpoint_problem``), else 422 naming ``checkpoint``; its
    ``trained`` (the samples the step trained, docs/datasets.md) may name a dataset version
    of the key's project only, else 422 naming ``trained.dataset_id``. Nothing is stored
    then."""
    ctx.access.check_run(key, run_id)
    stream = run_stream_id(run_id)
    result = _append_policy_updates(ctx, run_id, body, key.project)
    return AppendResult(stream_id=stream, version=result.version,
                        positions=list(result.positions), duplicate=result.duplicate)


def _policy_updates(events: Sequence[Any]) -> list[tuple[int, Mapping[str, Any]]]:
    return [(i, e) for i, e in enumerate(events)
            if isinstance(e, Mapping) and e.get("type") == "policy_updated"]


def _append_policy_updates(ctx: ApiContext, run_id: str, body: AppendRequest, project: str
                           ) -> StoreAppendResult:
    """Check the batch's ``policy_updated`` events (``append_run_events``) and append it.
    The versions are checked against the newest read after the stream's version, and the
    batch appended at that stream version: an update that lands in between makes the
    append conflict, and the check runs again (for ``expected_version`` ``"any"``; a
    client's own expected version is the client's to retry). A ``trained.dataset_id`` must
    name a dataset version of ``project``."""
    stream = run_stream_id(run_id)
    updates = _policy_updates(body.events)
    root = serving.checkpoint_root(ctx.settings)
    for index, event in updates:
        problem = serving.checkpoint_problem(event.get("checkpoint"), root)
        if problem is not None:
            raise ApiError(422, "invalid_event", f"event {index}, field 'checkpoint': {problem}",
                           event_index=index, field="checkpoint")
        trained = event.get("trained")
        dataset_id = trained.get("dataset_id") if isinstance(trained, Mapping) else None
        if (isinstance(dataset_id, int) and not isinstance(dataset_id, bool)
                and 1 <= dataset_id < 2**63
                and lineage.dataset_project(ctx.store.db, dataset_id) != project):
            raise ApiError(422, "invalid_event", f"event {index}, field 'trained.dataset_id': "
                           f"no dataset version {dataset_id} in project {project!r}",
                           event_index=index, field="trained.dataset_id")
    ids = [e.get("event_id") for _, e in updates]
    if ids and all(isinstance(i, str) for i in ids) and _all_stored(ctx, ids):
        # A retry: the store answers it as one (or refuses other content under those ids).
        return append_batch(ctx.store, stream, body.events,
                            expected_version=body.expected_version, allowed={"policy_updated"})
    while True:
        current = ctx.store.stream_version(stream)
        if isinstance(body.expected_version, int) and body.expected_version != current:
            raise store_errors.ConflictError(stream, expected=body.expected_version,
                                             actual=current)
        _check_versions(updates, serving.newest_policy_version(ctx.store, run_id))
        try:
            return append_batch(ctx.store, stream, body.events,
                                expected_version=current if body.expected_version == "any"
                                else body.expected_version, allowed={"policy_updated"})
        except store_errors.ConflictError:
            if body.expected_version != "any":
                raise


def _all_stored(ctx: ApiContext, ids: list[Any]) -> bool:
    """Whether every one of ``ids`` (texts) is a stored event id (a retried batch)."""
    try:
        wanted = {uuid.UUID(i) for i in ids}
    except ValueError:
        return False  # the store names the malformed id
    return queries.stored_event_ids(ctx.store, list(wanted)) == wanted


def _check_versions(updates: list[tuple[int, Mapping[str, Any]]], newest: int) -> None:
    """ApiError 422 naming ``version`` (and the version expected) unless the updates carry
    ``newest + 1``, ``newest + 2``, … in order."""
    expected = newest + 1
    for index, event in updates:
        version = event.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version != expected:
            raise ApiError(
                422, "invalid_event",
                f"event {index}, field 'version': a policy_updated must carry the run's "
                f"newest policy version + 1: expected {expected}, got {version!r:.60}",
                event_index=index, field="version", expected_policy_version=expected)
        expected += 1


@router.post("/{run_id}/served", status_code=201, response_model=PolicyServedOut)
def report_policy_served(run_id: str, body: PolicyServedIn, key: TrainKey, ctx: Ctx
                         ) -> PolicyServedOut:
    """A rollout engine reports that it now serves ``version`` of the run (appends
    ``policy_served`` to the run's stream; a ``train`` or ``admin`` key). 404 for an
    unknown run; 422 naming the field for a wrong type, a negative version, a version the
    run never recorded, a blank engine or backend, or a negative ``load_seconds``."""
    ctx.access.check_run(key, run_id)
    result = serving.record_policy_served(
        ctx.store, run_id, version=body.version, engine=body.engine, backend=body.backend,
        source=body.source,
        load_seconds=None if body.load_seconds is None else float(body.load_seconds))
    return PolicyServedOut(run_id=run_id, version=result.version, position=result.positions[0])


@router.get("/{run_id}/policies", response_model=PolicyTakeup)
def policy_takeup(run_id: str, key: ReadKey, ctx: Ctx) -> PolicyTakeup:
    """Every policy version of the run, oldest first: when it was recorded, which engines
    took it, when, and the lag from ``policy_updated`` to each take-up; and the highest
    version each engine reported. Checkpoint locations are not shown (server paths). 404
    for an unknown run."""
    ctx.access.check_run(key, run_id)
    versions = serving.policy_takeup(ctx.store, run_id)
    now: dict[str, int] = {}
    for item in versions:
        for engine in item.engines:
            now[engine.engine] = item.version
    return PolicyTakeup(run_id=run_id, serving=now, versions=[VersionTakeupOut(
        version=v.version, step=v.step, updated_at=v.updated_at,
        lag_max_seconds=v.lag_max_seconds,
        engines=[EngineTakeupOut(engine=e.engine, backend=e.backend, served_at=e.served_at,
                                 lag_seconds=e.lag_seconds, load_seconds=e.load_seconds,
                                 source=e.source) for e in v.engines]) for v in versions])


def _check_tools(config: Any, ctx: Ctx) -> None:
    """A run's own tools (``config.rollout.tool_modules``, ``config.rollout.mcp_servers``)
    must load, beside the server's, before the run is stored: a module that cannot be
    imported, an MCP server that is not an allowed address or cannot be listed, or a tool
    name two sources give is 422 naming it."""
    if not config.tool_modules and not config.mcp_servers:
        return
    field = "body.config.rollout.tool_modules"
    try:
        for url in config.mcp_servers:
            field = "body.config.rollout.mcp_servers"
            check_trainer_host(url, ctx.settings, field="config.rollout.mcp_servers")
        field = "body.config.rollout.tool_modules"
        offered_tools(ctx.settings, modules=config.tool_modules,
                      mcp_servers=config.mcp_servers)
    except ValueError as exc:
        if "MCP server" in str(exc):
            field = "body.config.rollout.mcp_servers"
        raise ApiError(422, "invalid_tools", f"the run's tools: {exc}", field=field) from None
