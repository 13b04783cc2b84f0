"""The web page: ``/ui``, read-only, server-rendered HTML over the same keys as the REST API.

Pages: ``/ui`` (the key's runs) → ``/ui/runs/{run}`` (the failure dashboard: charts by policy
version, failure patterns, error signatures, tool error rates, and the run's groups) →
``/ui/runs/{run}/groups/{group}`` (its episodes) → ``/ui/episodes/{episode}`` (the merged
timelines token by token, coloured by loss mask with the logprob on hover; tool calls and
errors inline; each LLM call's latency, tokens and state, failed calls flagged; the
rolled-back attempts as negative samples; the event log; an episode replay refuses shows its
reason and events). ``/ui/search?q=`` finds episodes by episode id, task id or error. Wide
tables scroll inside their box, so a page fits the window.

A browser cannot send a bearer header on a link, so ``/ui/login`` takes a key once (any key
with the ``read`` role, or ``admin``) and keeps a session in an HttpOnly, SameSite=Strict
cookie scoped to ``/ui``: not the key, but a MAC over the key's id and an expiry keyed by its
stored secret hash (``KeyStore.session``), good for eight hours, until the key is revoked or
until signing out (which ends it on the server: ``KeyStore.end_session``).
A sign-in or sign-out posted from another site (its Origin or Referer names another host) is
refused. Every page is sent with a Content-Security-Policy that allows only this server's own
scripts, and with frame, sniffing and referrer headers. A request may also carry the key as
the REST API takes it. Without a
valid key a page redirects to the login form; a key of the wrong role is refused there;
another project's run or episode is a 403 page, an unknown one a 404 page. In local mode
(``TRAJSTORE_LOCAL_MODE``) a request without a key sees the local project's pages, and every
page carries a banner saying that no key is asked for. The page loads
nothing from outside the server: the chart library is vendored under ``/ui/static``.
"""

from __future__ import annotations

import urllib.parse
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import MutableHeaders

from api.deps import Ctx, source_address
from api.errors import ApiError
from api.keys import SESSION_PREFIX, ApiKey, KeyFailureBudgetExceeded
from api.routers.runs import run_out, run_summary
from api.schemas.runs import RunOut
from api.ui import data
from store import queries

__all__ = ["COOKIE", "STATIC_DIR", "LoginRequired", "PageError", "install", "router"]

COOKIE = "trajstore_key"
# Sent with every page: only this server's own scripts and styles (Chart.js sets styles from
# script, hence 'unsafe-inline' for styles only), never framed, no type sniffing, no referrer
# sent off-site (a form post still carries its Origin, which sign-in checks).
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self' "
                               "'unsafe-inline'; img-src 'self' data:; frame-ancestors 'none'; "
                               "base-uri 'none'; form-action 'self'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}
# How long a sign-in lasts; the key's revocation ends it sooner.
SESSION_S = 8 * 3600.0
HERE = Path(__file__).resolve().parent
STATIC_DIR = HERE / "static"
templates = Jinja2Templates(directory=HERE / "templates")


def _num(v: Any, digits: int = 3) -> str:
    """A number as the tables show it: floats to ``digits`` places without trailing zeros."""
    if v is None:
        return ""
    if not isinstance(v, float):
        return str(v)
    text = f"{v:.{digits}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


templates.env.filters["num"] = _num
templates.env.filters["pct"] = lambda v: "" if v is None else f"{100 * v:.1f}%"

router = APIRouter(prefix="/ui", include_in_schema=False)


class LoginRequired(Exception):
    """No usable key: the page sends the browser to the login form."""

    def __init__(self, next_path: str) -> None:
        super().__init__(next_path)
        self.next_path = next_path


class PageError(Exception):
    """A page that cannot be shown: rendered as an error page with ``status``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _token_of(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip() or None
    return (request.headers.get("x-api-key") or request.cookies.get(COOKIE) or "").strip() or None


async def _check(ctx: Any, token: str | None, request: Request) -> ApiKey | None:
    if not token:
        return None
    if token.startswith(SESSION_PREFIX):
        return await run_in_threadpool(ctx.keys.verify_session, token)
    source = source_address(request)
    try:
        return ctx.keys.trusted(token) or (
            None if ctx.keys.refused(token, source)
            else await run_in_threadpool(ctx.keys.verify, token, source))
    except KeyFailureBudgetExceeded as exc:
        raise PageError(429, f"Too many wrong keys lately; try again in {exc.retry_after_s} "
                        "seconds.") from None


def _same_origin(request: Request) -> bool:
    """Whether a form post comes from this site's own pages: its Origin (or, without one,
    its Referer) names this host; a client that sends neither is not a browser."""
    sent = request.headers.get("origin") or request.headers.get("referer")
    if not sent:
        return True
    parts = urllib.parse.urlsplit(sent)
    return (parts.scheme, parts.netloc) == (request.url.scheme, request.url.netloc)


async def page_key(request: Request, ctx: Ctx) -> ApiKey:
    """The request's key, when it is live and may read (in local mode, the local key when
    the request carries none); otherwise LoginRequired."""
    token = _token_of(request)
    if token is None and ctx.local_key is not None:
        return ctx.local_key
    key = await _check(ctx, token, request)
    if key is None or not key.allows("read"):
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        raise LoginRequired(path)
    return key


PageKey = Annotated[ApiKey, Depends(page_key)]


def _page(request: Request, name: str, status_code: int = 200, **context: Any
          ) -> HTMLResponse:
    """Render ``name``; every page says when the server runs in local mode (a banner)."""
    ctx = getattr(request.app.state, "ctx", None)
    context.setdefault("local_project", ctx.settings.local_project
                       if ctx is not None and ctx.settings.local_mode else None)
    return templates.TemplateResponse(request, name, context, status_code=status_code)


def _safe_next(value: str | None) -> str:
    """Only a path of this UI: never an absolute URL (no open redirect)."""
    if value and value.startswith("/ui") and not value.startswith("//"):
        return value
    return "/ui"


class _PageHeaders:
    """ASGI middleware setting ``PAGE_HEADERS`` on the answers under ``/ui``; every other
    request passes untouched (a plain ASGI layer: no task or stream per request, as
    Starlette's ``BaseHTTPMiddleware`` would cost every API request)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope.get("path", "").startswith("/ui"):
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in PAGE_HEADERS.items():
                    headers[name] = value
            await send(message)

        await self.app(scope, receive, with_headers)


def install(app: Any) -> None:
    """Add the pages, the static files and the page errors to ``app``."""
    from fastapi.staticfiles import StaticFiles

    app.include_router(router)
    app.mount("/ui/static", StaticFiles(directory=STATIC_DIR), name="ui-static")

    app.add_middleware(_PageHeaders)

    @app.exception_handler(LoginRequired)
    async def login_required(request: Request, exc: LoginRequired) -> Response:
        target = "/ui/login?" + urllib.parse.urlencode({"next": exc.next_path})
        return RedirectResponse(target, status_code=303)

    @app.exception_handler(PageError)
    async def page_error(request: Request, exc: PageError) -> Response:
        return _page(request, "error.html", exc.status, status=exc.status,
                     message=exc.message, key=None)


async def _guard(call: Any, *args: Any) -> Any:
    """Run a store call in a thread; an ApiError (403, 404, 409) becomes an error page."""
    try:
        return await run_in_threadpool(call, *args)
    except ApiError as exc:
        raise PageError(exc.status, exc.message) from None


@router.get("/login", response_class=HTMLResponse)
async def login_form(request: Request, next: str = "/ui") -> HTMLResponse:
    """The form that takes a key."""
    return _page(request, "login.html", next=_safe_next(next), error=None, key=None)


@router.post("/login")
async def login(request: Request, ctx: Ctx) -> Response:
    """Check the posted key; on success keep it in the cookie and go on to ``next``."""
    if not _same_origin(request):
        raise PageError(403, "A sign-in posted from another site is refused.")
    form = urllib.parse.parse_qs((await request.body()).decode("utf-8", "replace"))
    token = (form.get("key") or [""])[0].strip()
    target = _safe_next((form.get("next") or ["/ui"])[0])
    key = await _check(ctx, token, request)
    if key is None:
        return _page(request, "login.html", 401, next=target, key=None,
                     error="That key is unknown, malformed or revoked.")
    if not key.allows("read"):
        return _page(request, "login.html", 403, next=target, key=None,
                     error=f"That key has role {key.role!r}; the pages need 'read' or "
                           "'admin'.")
    response = RedirectResponse(target, status_code=303)
    session = await run_in_threadpool(ctx.keys.session, key, ttl_s=SESSION_S)
    response.set_cookie(COOKIE, session, httponly=True, samesite="strict", path="/ui",
                        secure=request.url.scheme == "https", max_age=int(SESSION_S))
    return response


@router.post("/logout")
async def logout(request: Request, ctx: Ctx) -> Response:
    """End the session on the server (``KeyStore.end_session``: its cookie no longer signs
    in anywhere, even if kept or copied) and clear the cookie."""
    if not _same_origin(request):
        raise PageError(403, "A sign-out posted from another site is refused.")
    token = (request.cookies.get(COOKIE) or "").strip()
    if token.startswith(SESSION_PREFIX):
        await run_in_threadpool(ctx.keys.end_session, token)
    response = RedirectResponse("/ui/login", status_code=303)
    response.delete_cookie(COOKIE, path="/ui")
    return response


@router.get("", response_class=HTMLResponse)
async def runs_page(request: Request, key: PageKey, ctx: Ctx) -> HTMLResponse:
    """The key's project's runs, newest first."""
    def load() -> list[RunOut]:
        records = queries.list_runs(ctx.store, key.project)
        return [run_out(ctx, r) for r in reversed(records)]

    runs = await run_in_threadpool(load)
    return _page(request, "runs.html", key=key, runs=runs)


@router.get("/runs/{run_id}", response_class=HTMLResponse)
async def run_page(request: Request, run_id: str, key: PageKey, ctx: Ctx) -> HTMLResponse:
    """One run: summary, failure dashboard and its groups."""
    await _guard(ctx.access.check_run, key, run_id)

    def load() -> dict[str, Any]:
        return {"run": run_summary(ctx, run_id),
                "dashboard": data.dashboard(ctx.store, run_id),
                "groups": queries.run_groups(ctx.store, run_id)}

    return _page(request, "run.html", key=key, **await run_in_threadpool(load))


@router.get("/runs/{run_id}/groups/{group_id}", response_class=HTMLResponse)
async def group_page(request: Request, run_id: str, group_id: str, key: PageKey, ctx: Ctx
                     ) -> HTMLResponse:
    """The episodes of one group."""
    await _guard(ctx.access.check_run, key, run_id)
    episodes = await run_in_threadpool(data.group_page, ctx.store, run_id, group_id)
    if not episodes:
        raise PageError(404, f"run {run_id!r} has no group {group_id!r}")
    return _page(request, "group.html", key=key, run_id=run_id, group_id=group_id,
                 episodes=episodes)


@router.get("/search", response_class=HTMLResponse)
async def search_page(request: Request, key: PageKey, ctx: Ctx, q: str = "") -> HTMLResponse:
    """The episodes of the key's project where ``q`` occurs: in the episode or task id, or
    in an error (``store.search``). A blank or over-long query is said on the page."""
    limit, found, problem = 50, [], None
    if not q.strip():
        problem = "Type part of an episode id, a task id or an error to search for."
    elif len(q) > 200:
        problem = "Search for at most 200 characters."
    else:
        found = await run_in_threadpool(data.search_page, ctx.store, key.project, q,
                                        limit=limit)
    return _page(request, "search.html", key=key, query=q, found=found, problem=problem,
                 limit=limit)


@router.get("/episodes/{episode_id}", response_class=HTMLResponse)
async def episode_page(request: Request, episode_id: str, key: PageKey, ctx: Ctx
                       ) -> HTMLResponse:
    """One episode: its merged timelines token by token, negatives, forks and events."""
    await _guard(ctx.access.check_episode, key, episode_id)
    page = await _guard(data.episode_page, ctx.store, episode_id)
    return _page(request, "episode.html", key=key, **page)
