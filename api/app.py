"""The FastAPI application: ``create_app(settings)``; ``app_factory`` for uvicorn.

One process serves ingest (events, and OpenTelemetry spans on ``/v1/traces``), queries,
exports, batches over HTTP, the capture gateway and the remote-rollout endpoints. Every
route except ``/health`` and ``/ready`` needs an API key (in local mode a request without
one acts as the local project's admin, said in a log line at start); every error is
``{"error": {"code", "message", ...}}``. Run it with ``trajstore serve``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from api.context import ApiContext
from api.errors import install_error_handlers
from api.limits import BodyLimit, FairShare, NoNulInUrl, RefusalBudget
from api.openapi import install_openapi
from api.routers import (
    analytics,
    completions,
    credentials,
    datasets,
    episodes,
    health,
    leases,
    lineage,
    metrics,
    rollout,
    runs,
    samples,
    traces,
)
from api.ui import routes as ui
from store import heap
from store.eventlog import EventStore
from store.settings import Settings, get_settings

__all__ = ["app_factory", "create_app"]

log = logging.getLogger(__name__)

DESCRIPTION = """\
The REST face of trajstore, an event-sourced trajectory store for agentic RL.

Authenticate with `Authorization: Bearer <key>` (or `X-API-Key`); keys are made with
`trajstore keys create --project P --role ingest|read|admin`. Token payloads travel as
JSON arrays or as base64 of little-endian int32 ids / float32 logprobs.
"""


def create_app(settings: Settings | None = None, *, store: EventStore | None = None,
               freeze_heap: bool = False) -> FastAPI:
    """The API over ``store`` (default: the store the settings name, opened at startup
    and closed at shutdown). ``freeze_heap``: the process serves this app alone (``trajstore
    serve``): once started, what it holds is frozen out of the garbage collector's full
    collections (``store.heap``, ``GC_FREEZE_AFTER_MS``)."""
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        own = store is None
        opened = EventStore.open(settings) if own else store
        assert opened is not None
        ctx = ApiContext.build(settings, opened, owns_store=own)
        app.state.ctx = ctx
        if settings.local_mode:
            log.warning("LOCAL MODE: requests without an API key act as the admin of project "
                        "%r (TRAJSTORE_LOCAL_MODE); serve it on loopback only",
                        settings.local_project)
        if settings.gateway_engine_model and not settings.gateway_upstream_url:
            # Load the in-process engine now: a bad model folder fails the start, and the
            # first call does not wait for the model.
            await run_in_threadpool(ctx.gateway.engine)
        if freeze_heap:
            heap.install(settings.gc_freeze_after_ms)
            heap.freeze(collect=True)
        try:
            yield
        finally:
            if ctx._gateway is not None:
                await ctx._gateway.aclose()
            ctx.close()

    app = FastAPI(title="trajstore", version="0.1.0", description=DESCRIPTION,
                  lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=settings.api_max_request_bytes)
    # Outside BodyLimit: a project over its refusal budget is answered before its body is read.
    app.add_middleware(RefusalBudget, budget=settings.api_refusal_budget,
                       window_s=settings.api_refusal_window_s)
    # Outside the refusal budget: a project over its share waits before anything is read.
    app.add_middleware(FairShare, max_delay_s=settings.api_share_max_delay_s,
                       busy_from=settings.api_share_busy)
    app.add_middleware(NoNulInUrl)
    install_error_handlers(app)
    for module in (health, metrics, runs, episodes, credentials, samples, leases, completions,
                   rollout, analytics, traces, datasets, lineage):
        app.include_router(module.router)
    ui.install(app)
    install_openapi(app)
    return app


def app_factory() -> FastAPI:
    """The app as the environment configures it (``uvicorn --factory api.app:app_factory``),
    in a process that serves it alone."""
    return create_app(freeze_heap=True)
