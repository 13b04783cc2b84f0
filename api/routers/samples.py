"""Samples of a run (positive and negative), one page at a time, and the run's exports
(Parquet with the columns a verl trainer reads, verl's prompt dataset and padded batch, ATIF
trajectories, SFT JSON lines; :mod:`api.exports`)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from api import exports, verl_columns
from api.cursor import decode_cursor, encode_cursor
from api.deps import Ctx, ReadKey
from api.errors import ERROR_RESPONSES
from api.parquet import PARQUET_MEDIA_TYPE
from api.places import Held
from api.schemas.samples import SamplePage
from api.tokens import Encoding
from store import queries

__all__ = ["router"]

router = APIRouter(prefix="/v1/runs/{run_id}", tags=["samples"], responses=ERROR_RESPONSES)

SampleKind = Literal["positive", "negative"]
SampleStatus = Literal["ready", "leased", "consumed", "stale", "skipped", "no_reward"]


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


_EXPORT_CONTENT: dict[str, dict[str, object]] = {
    PARQUET_MEDIA_TYPE: {}, exports.SAFETENSORS_MEDIA_TYPE: {}, exports.JSONL_MEDIA_TYPE: {}}


@router.get("/export", response_class=StreamingResponse,
            responses={200: {"content": _EXPORT_CONTENT,
                             "description": "The export, streamed (Parquet, safetensors or "
                                            "JSON lines, by format)."}})
@router.get("/export.parquet", response_class=StreamingResponse,
            responses={200: {"content": _EXPORT_CONTENT,
                             "description": "The same as /export (samples by default)."}})
def export(
    run_id: str,
    key: ReadKey,
    ctx: Ctx,
    format: exports.ExportFormat = "samples",  # noqa: A002 - the query parameter's name
    group_id: str | None = None,
    kind: SampleKind | None = None,
    status: SampleStatus | None = None,
    min_reward: float | None = None,
    data_source: str | None = None,
    pad_token_id: Annotated[int | None, Query(ge=0)] = None,
) -> StreamingResponse:
    """The run in one of the export formats (docs/exports.md):

    - ``samples`` (default): the samples as Parquet with verl's columns (``prompt_ids``,
      ``response_ids``, ``response_mask``, ``rollout_log_probs``, ``reward``, ``uid``,
      ``is_negative`` …), one row group at a time; filters ``group_id``, ``kind``, ``status``.
    - ``verl-prompts``: the run's tasks as the Parquet prompt dataset verl's ``RLHFDataset``
      reads (``prompt``, ``data_source``, ``reward_model``, ``extra_info``); ``data_source``.
    - ``verl-batch``: the samples as one padded batch with verl's tensor names in a
      safetensors file; the sample filters and ``pad_token_id``.
    - ``atif``: one ATIF v1.7 trajectory per finished episode, JSON lines; ``min_reward``.
    - ``sft``: chat messages and tools per merged timeline of each finished episode whose
      reward is at least ``min_reward``, JSON lines.

    An option the format does not take is refused (422). Everything is checked, and the
    first part built, before the answer starts. A project streams at most
    ``TRAJSTORE_API_EXPORT_PROJECT_RUNNING`` exports (of runs and dataset versions) at once
    from one API process: one more is a 429 naming the setting."""
    ctx.access.check_run(key, run_id)
    give_back = ctx.exports.take(key.project, ctx.settings.api_export_project_running)
    try:
        made = exports.prepare(
            ctx.store, run_id, format, group_id=group_id, kind=kind, status=status,
            min_reward=min_reward, data_source=data_source, pad_token_id=pad_token_id,
            rows_per_group=ctx.settings.api_export_rows_per_group)
    except BaseException:
        give_back()
        raise
    return StreamingResponse(
        Held(made.chunks, give_back), media_type=made.media_type,
        headers={"Content-Disposition": f'attachment; filename="{made.filename}"'},
    )
