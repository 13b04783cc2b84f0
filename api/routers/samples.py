"""Samples of a run (positive and negative), one page at a time or as a streamed Parquet
export with the columns a verl trainer reads."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Annotated, Literal

import pyarrow as pa
from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from api import verl_columns
from api.cursor import decode_cursor, encode_cursor
from api.deps import Ctx, ReadKey
from api.errors import ERROR_RESPONSES
from api.parquet import PARQUET_MEDIA_TYPE, stream_parquet
from api.schemas.samples import SamplePage
from api.tokens import Encoding
from store import queries

__all__ = ["router"]

router = APIRouter(prefix="/v1/runs/{run_id}", tags=["samples"], responses=ERROR_RESPONSES)

SampleKind = Literal["positive", "negative"]
SampleStatus = Literal["ready", "leased", "consumed", "stale", "skipped"]


@router.get("/samples", response_model=SamplePage)
def list_samples(
    run_id: str,
    key: ReadKey,
    ctx: Ctx,
    group_id: str | None = None,
    kind: SampleKind | None = None,
    status: SampleStatus | None = None,
    tokens: bool = True,
    encoding: Encoding = "json",
    limit: Annotated[int | None, Query(ge=1)] = None,
    cursor: str | None = None,
) -> SamplePage:
    """Samples of the run (or one group), ``kind=negative`` for negative samples only, in
    the order they were projected; token columns unless ``tokens=false``."""
    ctx.access.check_run(key, run_id)
    size = min(limit or ctx.settings.api_page_size, ctx.settings.api_max_page_size)
    filters = queries.SampleFilters(run_id=run_id, group_id=group_id, kind=kind, status=status)
    rows = queries.list_samples(ctx.store, filters, after=decode_cursor(cursor),
                                limit=size + 1, tokens=tokens)
    more = len(rows) > size
    rows = rows[:size]
    return SamplePage.model_validate({
        "samples": [verl_columns.to_json(verl_columns.from_row(r), encoding=encoding,
                                         tokens=tokens) for r in rows],
        "next_cursor": encode_cursor(rows[-1]["sample_id"]) if more and rows else None,
    })


def _batches(ctx: Ctx, filters: queries.SampleFilters) -> Iterator[pa.RecordBatch]:
    for rows in queries.iter_samples(ctx.store, filters,
                                     chunk=ctx.settings.api_export_rows_per_group):
        yield verl_columns.record_batch([verl_columns.from_row(r) for r in rows])


@router.get("/export.parquet", response_class=StreamingResponse,
            responses={200: {"content": {PARQUET_MEDIA_TYPE: {}},
                             "description": "A Parquet file, streamed row group by row group."}})
def export_parquet(
    run_id: str,
    key: ReadKey,
    ctx: Ctx,
    group_id: str | None = None,
    kind: SampleKind | None = None,
    status: SampleStatus | None = None,
) -> StreamingResponse:
    """The run's samples as Parquet with verl's columns (``prompt_ids``, ``response_ids``,
    ``response_mask``, ``rollout_log_probs``, ``reward``, ``uid``, ``is_negative`` …),
    written and sent one row group at a time."""
    ctx.access.check_run(key, run_id)
    filters = queries.SampleFilters(run_id=run_id, group_id=group_id, kind=kind, status=status)
    # Run the query and build the first row group before answering: once the 200 is sent a
    # failure can only cut the body short, which a client may take for a complete file.
    batches = _batches(ctx, filters)
    first = list(itertools.islice(batches, 1))
    return StreamingResponse(
        stream_parquet(itertools.chain(first, batches), verl_columns.ARROW_SCHEMA),
        media_type=PARQUET_MEDIA_TYPE,
        headers={"Content-Disposition": f'attachment; filename="{run_id}.parquet"'},
    )
