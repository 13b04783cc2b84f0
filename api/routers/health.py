"""Liveness (``/health``: the process answers) and readiness (``/ready``: the database is
reachable and at the schema revision this code needs; it also says whether any process
replays finished episodes). Neither needs a key. ``/health`` also says whether the server
runs in local mode (requests without a key taken)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from api.deps import AnyKey, Ctx
from api.errors import ERROR_RESPONSES
from api.schemas.health import Health, Readiness, WhoAmI
from store import errors as store_errors
from store import migrate, queries
from store.followers import NO_REPLAY, REPLAY_FOLLOWER, leader_present

__all__ = ["router"]

router = APIRouter(tags=["health"])


@router.get("/health", response_model=Health, response_model_exclude_none=True)
async def health(ctx: Ctx) -> Health:
    """The process is up: ``{"status": "healthy"}``, the form the remote-rollout protocol's
    harness checks for; in local mode also ``"local_mode": true`` (requests without a key
    are taken)."""
    return Health(status="healthy", local_mode=True if ctx.local_key is not None else None)


@router.get("/ready", response_model=Readiness,
            responses={503: {"model": Readiness, "description": "Not ready (reason in detail)."}})
def ready(ctx: Ctx) -> JSONResponse:
    """Ready when the database answers and its schema revision is the newest this code
    knows; 503 otherwise. ``replay`` says whether a process follows the log to replay
    finished episodes (``following``: a replay worker, or ``trajstore serve``'s own copy)
    or none does (``none``, with the fix in ``warnings``)."""
    head = migrate.head_revision()
    try:
        queries.ping(ctx.store)
        current = migrate.current_revision(ctx.store.db.url)
    except (store_errors.StoreError, Exception) as exc:  # any failure means not ready
        body = Readiness(status="unavailable", database="unreachable", head=head,
                         detail=str(exc)[:300])
        return JSONResponse(body.model_dump(), status_code=503)
    if current != head:
        body = Readiness(status="unavailable", database="ok", revision=current, head=head,
                         detail=f"schema at {current}, needs {head}: run `trajstore migrate`")
        return JSONResponse(body.model_dump(), status_code=503)
    # Ingest works without replay, so this is no reason to take the API out of service;
    # but nothing ingested would ever become a sample, and that is said here.
    replaying = leader_present(ctx.store, REPLAY_FOLLOWER)
    return JSONResponse(Readiness(
        status="ready", database="ok", revision=current, head=head,
        replay="following" if replaying else "none",
        warnings=[] if replaying else [NO_REPLAY]).model_dump())


@router.get("/v1/keys/me", response_model=WhoAmI, tags=["keys"], responses=ERROR_RESPONSES)
def whoami(key: AnyKey) -> WhoAmI:
    """The key this request carries: its id, project and role."""
    return WhoAmI(key_id=key.key_id, project=key.project, role=key.role)
