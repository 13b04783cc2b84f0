"""``/metrics``: the store's figures in the Prometheus text format (``prometheus_client``).
They count every project's runs and samples, so an ``admin`` key is needed (any other key gets
403); configure the scraper with ``authorization: {credentials: <admin key>}``."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from api.deps import AdminKey, Ctx
from api.errors import ERROR_RESPONSES
from store.metrics import CONTENT_TYPE, render
from workers.queues import QueueCollector

__all__ = ["router"]

router = APIRouter(tags=["health"])


@router.get("/metrics", response_class=PlainTextResponse,
            responses={401: ERROR_RESPONSES[401], 403: ERROR_RESPONSES[403]})
def metrics(key: AdminKey, ctx: Ctx) -> PlainTextResponse:
    """Events appended by type, episodes by status, append latency (this process), replay
    lag in episodes and seconds, each log follower's lag, samples by status, live leases and
    the oldest one's age, lease expiries, tasks waiting per Celery queue, the trainer's last
    step time and tokens/s."""
    return PlainTextResponse(render(ctx.store, QueueCollector(ctx.settings)),
                             media_type=CONTENT_TYPE)
