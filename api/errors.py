"""Every error the API answers with is JSON: ``{"error": {"code", "message", ...}}``.

Store errors are translated here, once: validation → 422 (with ``event_index`` and
``field``), conflict → 409 (with ``current_version``; a late reward refused because samples
were taken: ``samples_consumed`` or ``samples_leased`` with ``samples`` naming them),
idempotency clash → 409, not found →
404, transient → 503. No body holds PostgreSQL's own text: a value the database refused is a
422 in the store's words naming the field (or, when the database cannot say which value, the
request's parameters it came from), and a 503 says only that the database is unavailable;
the server's text goes to the log. Request validation by FastAPI becomes 422 with the field
path; HTTP errors of Starlette (404 route, 405 method) keep their status. Anything unexpected
is a 500 with a generic message (the traceback goes to the log, not to the client).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.limits import LIMIT_CODES
from store import errors as store_errors
from store.validation import check_json

__all__ = [
    "refuse_unstorable",
    "ApiError",
    "error_body",
    "error_response",
    "field_path",
    "install_error_handlers",
    "ERROR_RESPONSES",
]

log = logging.getLogger(__name__)

_STATUS_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    410: "gone",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "invalid_request",
    429: "too_many_requests",
    501: "not_implemented",
    502: "upstream_error",
    503: "unavailable",
}


class ApiError(Exception):
    """An error with an HTTP status, a short machine-readable ``code`` and a message naming
    what is wrong; ``extra`` fields go into the error object beside them. ``refused_by_limit``
    (or a code of ``api.limits.LIMIT_CODES``) counts the refusal against the project's
    refusal budget."""

    def __init__(self, status: int, code: str, message: str, *,
                 headers: dict[str, str] | None = None, refused_by_limit: bool = False,
                 **extra: Any) -> None:
        super().__init__(message)
        self.refused_by_limit = refused_by_limit
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers
        self.extra = extra


def error_body(code: str, message: str, **extra: Any) -> dict[str, Any]:
    """The JSON body of an error."""
    return {"error": {"code": code, "message": message, **extra}}


def error_response(status: int, code: str, message: str, *,
                   headers: dict[str, str] | None = None, **extra: Any) -> JSONResponse:
    """A JSON error response. Written as ASCII JSON: a message or field name quoting a
    lone surrogate from the request still makes a valid body (not a 500)."""
    return _AsciiJSON(error_body(code, message, **extra), status_code=status, headers=headers)


class _AsciiJSON(JSONResponse):
    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False,
                          separators=(",", ":")).encode("ascii")


def field_path(loc: tuple[Any, ...] | list[Any]) -> str:
    """``("body", "events", 3, "logprobs")`` → ``"body.events[3].logprobs"``."""
    out = ""
    for item in loc:
        if isinstance(item, int):
            out += f"[{item}]"
        else:
            out += ("." if out else "") + str(item)
    return out or "(request)"


def _request_values(request: Request | None) -> list[str]:
    """The names of the request's path and query parameters (what a value the database
    refused may have come from), in the order given."""
    if request is None:
        return []
    names = [str(n) for n in request.path_params]
    names += [n for n in dict.fromkeys(request.query_params.keys()) if n not in names]
    return names


def _database_refusal(exc: store_errors.ValidationError, request: Request | None
                      ) -> JSONResponse:
    """A value the database refused: the store's words (``exc.reason``), naming the field
    when the store knew it, else the request's parameters it may have come from; the
    server's text is in the log only (``store.db``)."""
    extra: dict[str, Any] = {}
    if exc.event_index is not None:
        extra["event_index"] = exc.event_index
    if exc.field:
        extra["field"] = exc.field
        message = f"{exc.field}: {exc.reason}"
    else:
        names = _request_values(request)
        extra["field"] = names[0] if len(names) == 1 else "(request)"
        message = (f"{names[0]}: {exc.reason}" if len(names) == 1 else
                   f"{exc.reason}; it is one of the request's values "
                   f"({', '.join(names)} or the body)" if names else
                   f"{exc.reason} (a value of the request body)")
    return error_response(422, "invalid_request", message, **extra)


def _store_error(exc: store_errors.StoreError, request: Request | None = None) -> JSONResponse:
    if isinstance(exc, store_errors.ValidationError) and exc.from_database:
        return _database_refusal(exc, request)
    if isinstance(exc, store_errors.ValidationError):
        extra: dict[str, Any] = {}
        if exc.event_index is not None:
            extra["event_index"] = exc.event_index
        if exc.field:
            extra["field"] = exc.field
        return error_response(422, "invalid_event" if exc.event_index is not None
                              else "invalid_request", str(exc), **extra)
    if isinstance(exc, store_errors.SamplesTakenError):
        return error_response(409, "samples_consumed" if exc.consumed else "samples_leased",
                              str(exc), stream_id=exc.stream_id, current_version=exc.actual,
                              samples=exc.samples)
    if isinstance(exc, store_errors.ClosedError):
        return error_response(409, "episode_finished", str(exc), stream_id=exc.stream_id,
                              current_version=exc.actual)
    if isinstance(exc, store_errors.ConflictError):
        return error_response(409, "version_conflict", str(exc), stream_id=exc.stream_id,
                              current_version=exc.actual)
    if isinstance(exc, store_errors.IdempotencyError):
        known: dict[str, Any] = {} if exc.position is None else {"position": exc.position}
        return error_response(409, "idempotency_conflict", str(exc),
                              event_id=str(exc.event_id), **known)
    if isinstance(exc, store_errors.NotFoundError):
        return error_response(404, "not_found", str(exc))
    if isinstance(exc, store_errors.TransientError):
        log.warning("database unavailable: %s", exc)
        return error_response(503, "unavailable", "the database is unavailable; try again",
                              headers={"Retry-After": "1"})
    if type(exc).__name__ == "LeaseExpired":
        return error_response(409, "lease_ended", str(exc))
    log.error("store error: %s", exc)
    return error_response(500, "store_error", "the store failed; see the server log")


def install_error_handlers(app: FastAPI) -> None:
    """Register the JSON error handlers on ``app``."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        if exc.refused_by_limit or exc.code in LIMIT_CODES:
            request.state.limit_refusal = True  # counted by api.limits.RefusalBudget
        return error_response(exc.status, exc.code, exc.message, headers=exc.headers,
                              **exc.extra)

    @app.exception_handler(store_errors.StoreError)
    async def _store(request: Request, exc: store_errors.StoreError) -> JSONResponse:
        return _store_error(exc, request)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = exc.errors()
        first = problems[0] if problems else {"loc": (), "msg": "invalid request"}
        loc = tuple(first.get("loc", ()))
        extra: dict[str, Any] = {"field": field_path(loc)}
        if len(loc) >= 3 and loc[:2] == ("body", "events") and isinstance(loc[2], int):
            extra["event_index"] = loc[2]
        details = [{"field": field_path(tuple(p.get("loc", ()))), "message": p.get("msg", "")}
                   for p in problems[:20]]
        return error_response(422, "invalid_request",
                              f"{extra['field']}: {first.get('msg', 'invalid')}",
                              details=details, **extra)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _STATUS_CODES.get(exc.status_code, "error")
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return error_response(exc.status_code, code, message,
                              headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "internal_error", "internal error; see the server log")


def _error_schema(description: str) -> dict[str, Any]:
    from api.schemas.common import ErrorBody

    return {"model": ErrorBody, "description": description}


#: Error responses documented on every authenticated route.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: _error_schema("No API key, or an unknown or revoked one."),
    403: _error_schema("The key lacks the role, or the resource is another project's."),
    413: _error_schema("The request body is over the size limit."),
    422: _error_schema("The request is invalid; `field` (and `event_index`) say where."),
    429: _error_schema("Too many wrong secrets for this key id lately; retry after "
                       "`Retry-After` seconds."),
}


def refuse_unstorable(body: BaseModel) -> None:
    """Raise ``ApiError`` 422 naming the field when a request body holds a value the event
    log refuses (``store.validation.check_json``: NUL, a lone surrogate, nesting past 64
    levels, a non-finite number, an integer past 64 bits). For routes that look the body up
    or generate from it before it becomes events."""
    bad = check_json(body.model_dump(exclude_unset=True))
    if bad is not None:
        raise ApiError(422, "invalid_request", f"{bad[0]}: {bad[1]}", field=bad[0])
