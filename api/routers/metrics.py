"""``/metrics``: the store's figures in the Prometheus text format. They count every
project's runs and samples, so an ``admin`` key is needed (any other key gets 403); configure
the scraper with ``authorization: {credentials: <admin key>}``."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from api.deps import AdminKey, Ctx
from api.errors import ERROR_RESPONSES
from store.metrics import render

__all__ = ["router"]

router = APIRouter(tags=["health"])


@router.get("/metrics", response_class=PlainTextResponse,
            responses={401: ERROR_RESPONSES[401], 403: ERROR_RESPONSES[403]})
def metrics(key: AdminKey, ctx: Ctx) -> PlainTextResponse:
    """Events appended by type, append latency (this process), replay lag in episodes and
    seconds, samples by status, lease expiries, the trainer's last step time and tokens/s."""
    return PlainTextResponse(render(ctx.store),
                             media_type="text/plain; version=0.0.4; charset=utf-8")
