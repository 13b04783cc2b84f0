"""Failure analytics over HTTP: ``GET /v1/runs/{run_id}/analytics/<view>``, one route per view
of :data:`store.analytics.VIEWS` (``failures``, ``rollbacks``, ``tool-errors``, ``outcomes``,
``timelines``, ``negatives``, ``signatures``).

Each route takes the filters its view takes as query parameters (``min_version``,
``max_version``, ``since``, ``until``, ``tool``, ``error_type``), plus ``limit`` and
``format`` (``json``, the default, or ``csv``). ``since``/``until`` are ISO 8601 times (UTC
without an offset) or durations back from now (``30m``, ``24h``, ``7d``). The rows are the
view's, in its order, exactly as ``trajstore analytics <view> --format json|csv`` prints
them. Bad input is a 422 naming the parameter: a filter the view does not take, an unparsable
time, ``min_version > max_version``, ``since >= until``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, create_model
from starlette.concurrency import run_in_threadpool

from api.deps import Ctx, ReadKey
from api.errors import ERROR_RESPONSES, ApiError
from store import analytics
from store.analytics import VIEWS, AnalyticsView, Filters

__all__ = ["router"]

router = APIRouter(prefix="/v1/runs/{run_id}/analytics", tags=["analytics"],
                   responses=ERROR_RESPONSES)

_FILTER_PARAMETERS: dict[str, tuple[Any, Any]] = {
    "min_version": (Annotated[int | None, Query(ge=0, le=2**31 - 1, description="Lowest "
                                                "policy version (inclusive).")], None),
    "max_version": (Annotated[int | None, Query(ge=0, le=2**31 - 1, description="Highest "
                                                "policy version (inclusive).")], None),
    "since": (Annotated[str | None, Query(description="Episodes finished at or after: ISO 8601 "
                                          "time or a duration ago (30m, 24h, 7d).")], None),
    "until": (Annotated[str | None, Query(description="Episodes finished before: ISO 8601 "
                                          "time or a duration ago.")], None),
    "tool": (Annotated[str | None, Query(min_length=1, description="Tool name.")], None),
    "error_type": (Annotated[str | None, Query(min_length=1, description="Error type, e.g. "
                                               "TypeError.")], None),
}
_COMMON = {"limit", "format"}


def _page_model(spec: AnalyticsView) -> type[BaseModel]:
    return create_model(  # type: ignore[call-overload,no-any-return]
        f"{spec.row.__name__}Page",
        view=(str, ...),
        run_id=(str, ...),
        filters=(dict[str, Any], ...),
        columns=(list[str], ...),
        rows=(list[spec.row], ...),  # type: ignore[name-defined]
    )


def _filters(spec: AnalyticsView, run_id: str, request: Request, values: dict[str, Any]
             ) -> Filters:
    allowed = set(spec.filters) | _COMMON
    unknown = sorted(set(request.query_params) - allowed)
    if unknown:
        raise ApiError(422, "invalid_request",
                       f"view {spec.name!r} does not take the parameter(s) "
                       f"{', '.join(unknown)}; it takes "
                       f"{', '.join(sorted(allowed - {'run_id'}))}",
                       field=unknown[0])
    chosen = {name: values.get(name) for name in spec.filters if name != "run_id"}
    for name in ("since", "until"):
        text = chosen.get(name)
        if text is not None:
            try:
                chosen[name] = analytics.parse_time(text)
            except ValueError as exc:
                raise ApiError(422, "invalid_request", f"{name}: {exc}", field=name) from None
    try:
        return Filters(run_id=run_id, **chosen)
    except (TypeError, ValueError) as exc:
        raise ApiError(422, "invalid_request", str(exc)) from None


def _route(spec: AnalyticsView) -> Callable[..., Any]:
    """The endpoint of one view; its signature holds exactly the filters the view takes, so
    the OpenAPI document lists them."""

    async def handler(run_id: str, request: Request, key: ReadKey, ctx: Ctx,
                      **values: Any) -> Any:
        await run_in_threadpool(ctx.access.check_run, key, run_id)
        filters = _filters(spec, run_id, request, values)
        rows = await run_in_threadpool(analytics.query, ctx.store.db, spec, filters,
                                       limit=values.get("limit"))
        if values.get("format") == "csv":
            return Response(analytics.rows_as_csv(spec, rows), media_type="text/csv",
                            headers={"Content-Disposition":
                                     f'inline; filename="{spec.view}.csv"'})
        return {"view": spec.view, "run_id": run_id,
                "filters": {k: v for k, v in values.items()
                            if v is not None and k not in _COMMON},
                "columns": list(spec.columns),
                "rows": [analytics.row_as_dict(r) for r in rows]}

    base = [
        inspect.Parameter("run_id", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str),
        inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                          annotation=Request),
        inspect.Parameter("key", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=ReadKey),
        inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Ctx),
    ]
    filters = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                          default=default)
        for name, (annotation, default) in _FILTER_PARAMETERS.items() if name in spec.filters
    ]
    common = [
        inspect.Parameter("limit", inspect.Parameter.KEYWORD_ONLY,
                          annotation=Annotated[int | None, Query(ge=1, le=100_000,
                                                                 description="At most this "
                                                                 "many rows.")],
                          default=None),
        inspect.Parameter("format", inspect.Parameter.KEYWORD_ONLY,
                          annotation=Annotated[Literal["json", "csv"], Query(
                              description="json (default) or csv with a header row.")],
                          default="json"),
    ]
    handler.__signature__ = inspect.Signature([*base, *filters, *common])  # type: ignore[attr-defined]
    handler.__name__ = f"analytics_{spec.view}"
    handler.__doc__ = (f"{spec.summary} Rows of the view `{spec.view}` for the run, in the "
                       f"view's order; `format=csv` gives the same rows as CSV.")
    return handler


for _spec in VIEWS.values():
    router.add_api_route(
        f"/{_spec.name}", _route(_spec), methods=["GET"], response_model=_page_model(_spec),
        name=f"analytics_{_spec.view}",
        responses={200: {"content": {"text/csv": {"schema": {"type": "string"}}},
                         "description": "The view's rows (JSON, or CSV with format=csv)."}},
    )
