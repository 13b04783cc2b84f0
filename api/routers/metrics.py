"""``/metrics``: the store's figures in the Prometheus text format (any valid key; configure
the scraper with ``authorization: {credentials: <key>}``)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from api.deps import AnyKey, Ctx
from api.errors import ERROR_RESPONSES
from store.metrics import render

__all__ = ["router"]

router = APIRouter(tags=["health"])


@router.get("/metrics", response_class=PlainTextResponse,
            responses={401: ERROR_RESPONSES[401]})
def metrics(key: AnyKey, ctx: Ctx) -> PlainTextResponse:
    """Events appended by type, append latency (this process), replay lag in episodes and
    seconds, samples by status, lease expiries, the trainer's last step time and tokens/s."""
    return PlainTextResponse(render(ctx.store),
                             media_type="text/plain; version=0.0.4; charset=utf-8")
