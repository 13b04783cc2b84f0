"""Dependencies of the routes, as ``Annotated`` types (the one place they are defined).

``Ctx`` is the process's :class:`~api.context.ApiContext`. ``AnyKey``, ``IngestKey``,
``ReadKey``, ``TrainKey`` and ``AdminKey`` authenticate the request (``Authorization: Bearer
<key>`` or ``X-API-Key: <key>``) and answer 401 without a valid key (429 with Retry-After
while a key id has spent its budget of wrong secrets), 403 naming the role needed when the
key lacks it (``admin`` has every role, ``train`` also ``read``: ``api.keys``). In
``local_mode`` a request with no key at all acts as the admin of ``local_project``; a key it
does carry is checked as always. Project checks need the resource and happen in the
routes, through ``ctx.access``.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from api.context import ApiContext
from api.errors import ApiError
from api.keys import ApiKey, KeyFailureBudgetExceeded

__all__ = ["AdminKey", "AnyKey", "Ctx", "IngestKey", "ReadKey", "TrainKey", "authenticate",
           "get_context"]

_bearer = HTTPBearer(auto_error=False, description="`Authorization: Bearer tsk_…`")
_header = APIKeyHeader(name="X-API-Key", auto_error=False, description="`X-API-Key: tsk_…`")


async def get_context(request: Request) -> ApiContext:
    """The process's shared context."""
    return request.app.state.ctx  # type: ignore[no-any-return]


Ctx = Annotated[ApiContext, Depends(get_context)]


#: What the credential of one episode may call (``ApiKey.episode_id``): the completions
#: endpoints, the completion report and the model list; paths under ``/v1/runs/`` only within
#: its own episode (checked below). The routes check the episode a body names.
_EPISODE_KEY_PATHS = frozenset({"/v1/completions", "/v1/chat/completions",
                                "/v1/rollout/completed", "/v1/models"})


def _episode_key_allows(key: ApiKey, path: str) -> bool:
    if path in _EPISODE_KEY_PATHS or path.startswith("/v1/models/"):
        return True
    return path.startswith(f"/v1/runs/{key.run_id}/episodes/{key.episode_id}/")


def source_address(request: Request) -> str:
    """The client's address a request came from (the peer of the connection), which the
    budget of wrong secrets is kept per (``api.keys``); empty when unknown."""
    return request.client.host if request.client is not None else ""


async def authenticate(
    request: Request,
    ctx: Ctx,
    bearer: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)],
    header: Annotated[str | None, Security(_header)],
) -> ApiKey:
    """The live key the request carries (in local mode, the local key when it carries
    none); ApiError 401 when it carries none, or an unknown,
    malformed or revoked one, or a wrong secret; 429 with Retry-After when its key id had too
    many wrong secrets lately from this request's source address and this secret was not
    checked (``api.keys``). A key this
    process trusts is accepted without leaving the event loop; any other is checked against
    the database in a worker thread. The credential of one episode (``ApiKey.episode_id``)
    reaches only the completions endpoints, the completion report, the model list and its
    own episode's paths (403 for any other route)."""
    token = bearer.credentials if bearer is not None else header
    if not token and ctx.local_key is not None:
        return ctx.local_key
    if not token:
        raise ApiError(401, "unauthorized",
                       "an API key is required: Authorization: Bearer <key> or X-API-Key",
                       headers={"WWW-Authenticate": "Bearer"})
    token = token.strip()
    source = source_address(request)
    try:
        key = ctx.keys.trusted(token) or (
            None if ctx.keys.refused(token, source)
            else await run_in_threadpool(ctx.keys.verify, token, source))
    except KeyFailureBudgetExceeded as exc:
        raise ApiError(429, "too_many_requests",
                       "too many wrong secrets for this API key id lately; this one was not "
                       f"checked: retry after {exc.retry_after_s} s",
                       headers={"Retry-After": str(exc.retry_after_s)}) from None
    if key is None:
        raise ApiError(401, "unauthorized", "the API key is unknown, malformed or revoked",
                       headers={"WWW-Authenticate": "Bearer"})
    if key.episode_id is not None and not _episode_key_allows(key, request.url.path):
        raise ApiError(403, "forbidden", f"this credential may record only episode "
                                         f"{key.episode_id!r}: {request.url.path} is not "
                                         "open to it")
    return key


AnyKey = Annotated[ApiKey, Depends(authenticate)]


def _role(role: str):  # type: ignore[no-untyped-def]
    async def check(key: AnyKey) -> ApiKey:
        if not key.allows(role):
            raise ApiError(403, "forbidden",
                           f"this key has role {key.role!r}; this route needs {role!r}")
        return key

    check.__name__ = f"require_{role}"
    return check


IngestKey = Annotated[ApiKey, Depends(_role("ingest"))]
ReadKey = Annotated[ApiKey, Depends(_role("read"))]
TrainKey = Annotated[ApiKey, Depends(_role("train"))]
AdminKey = Annotated[ApiKey, Depends(_role("admin"))]
