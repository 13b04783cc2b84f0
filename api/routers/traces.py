"""``POST /v1/traces``: OTLP/HTTP trace export (protobuf or JSON, optionally gzip), stored as
episodes' events (``api.otlp``; the mapping is in ``docs/otlp.md``).

Answers as the OTLP specification says: 200 with an ``ExportTraceServiceResponse`` in the
request's encoding, whose ``partial_success`` counts the spans refused (those of finished
episodes) and says why. A malformed export is a 400 naming what is wrong, and stores
nothing; an unsupported Content-Type or Content-Encoding a 415; spans naming another
project's episode or run a 403, storing nothing; an export over a limit of
``api.otlp.decode`` a 413 naming it, one more than a project may have in progress a 429
(``api.otlp.pool``). Errors are JSON, as on every route.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, Request, Response
from starlette.concurrency import run_in_threadpool

from api.deps import Ctx, IngestKey
from api.errors import ERROR_RESPONSES, ApiError
from api.otlp.decode import (
    OtlpError,
    OtlpLimits,
    encode_response,
    media_type,
)
from api.otlp.ingest import store_spans
from api.otlp.pool import Admission, decode_export

__all__ = ["router"]

router = APIRouter(tags=["otlp"], responses=ERROR_RESPONSES)

_CODES = {400: "invalid_otlp", 413: "payload_too_large", 415: "unsupported_media_type"}

_BODY = {"content": {"application/x-protobuf": {"schema": {"type": "string",
                                                            "format": "binary"}},
                     "application/json": {"schema": {"type": "object"}}},
         "description": "An OTLP ExportTraceServiceRequest.", "required": True}


@router.post(
    "/v1/traces", response_class=Response, openapi_extra={"requestBody": _BODY},
    responses={200: {"content": {"application/x-protobuf": {}, "application/json": {}},
                     "description": "An ExportTraceServiceResponse (partial_success names "
                                    "spans refused)."},
               400: ERROR_RESPONSES[422] | {"description": "The export cannot be read."},
               415: ERROR_RESPONSES[422] | {"description": "Not protobuf nor JSON, or "
                                                           "not gzip."}})
async def export_traces(
    request: Request, key: IngestKey, ctx: Ctx,
    x_trajstore_run: Annotated[str | None, Header(
        description="The run of episodes whose spans name none (default "
                    "`otlp-<project>`).")] = None,
) -> Response:
    """Store the spans of an OTLP trace export as episodes' events."""
    settings = ctx.settings
    max_bytes = min(settings.otlp_max_bytes, settings.api_max_request_bytes)
    admission = getattr(request.app.state, "otlp_admission", None)
    if admission is None:
        admission = request.app.state.otlp_admission = Admission()
    with admission.enter(key.project, settings.otlp_max_concurrent):
        try:
            kind = media_type(request.headers.get("content-type"))
            spans = await decode_export(
                await request.body(), request.headers.get("content-encoding"), kind,
                OtlpLimits.of(settings), max_bytes=max_bytes,
                processes=settings.otlp_decode_processes)
            outcome = await run_in_threadpool(
                store_spans, ctx.store, settings, ctx.access, ctx.gateway.capture, key,
                spans, header_run=x_trajstore_run)
        except OtlpError as exc:
            extra: dict[str, Any] = {"field": exc.where} if exc.where else {}
            raise ApiError(exc.status, _CODES.get(exc.status, "invalid_otlp"), str(exc),
                           **extra) from None
    return Response(encode_response(kind, rejected=outcome.rejected_spans,
                                    message=outcome.message), media_type=kind)
