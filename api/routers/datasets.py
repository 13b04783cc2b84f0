"""Datasets (docs/datasets.md): derive a named, versioned dataset from runs' logs under
stated rules (``ingest``), list, read and compare versions (``read``), delete a version that
no training step trained (``admin``). A version is never changed."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Response
from fastapi.responses import StreamingResponse

from api import exports
from api.context import ApiContext
from api.deps import AdminKey, Ctx, IngestKey, ReadKey
from api.errors import ERROR_RESPONSES, ApiError
from api.parquet import PARQUET_MEDIA_TYPE
from api.places import Held
from api.schemas.datasets import (
    DatasetDerive,
    DatasetDiffOut,
    DatasetList,
    DatasetOut,
    DatasetRowOut,
    DatasetRows,
)
from store import errors as store_errors
from store.datasets import DatasetVersion, delete_version, get_version, list_versions, read_rows
from workers.datasets.compare import diff_datasets, parse_ref
from workers.datasets.derive import derive_dataset

__all__ = ["router"]

router = APIRouter(prefix="/v1/datasets", tags=["datasets"], responses=ERROR_RESPONSES)

DatasetName = Annotated[str, Path(min_length=1, max_length=100,
                                  pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
Version = Annotated[int, Path(ge=1, le=2_147_483_647)]


def dataset_out(v: DatasetVersion, *, created: bool | None = None,
                from_projection: int | None = None, replayed: int | None = None
                ) -> DatasetOut:
    return DatasetOut(name=v.name, version=v.version, project=v.project,
                      content_hash=v.content_hash, rules=v.rules, run_ids=v.run_ids,
                      code_version=v.code_version, rows=v.num_rows, episodes=v.num_episodes,
                      excluded=v.excluded, created_at=v.created_at, trained_by=v.trained_by,
                      created=created, from_projection=from_projection, replayed=replayed)


def _found(ctx: ApiContext, project: str, name: str, version: int) -> DatasetVersion:
    found = get_version(ctx.store.db, project, name, version)
    if found is None:
        raise ApiError(404, "not_found", f"no dataset {name!r} version {version}")
    return found


def _reward_module_allowed(function: str, allowed: str) -> bool:
    """Whether ``function``'s module is one ``allowed`` (comma separated modules or
    packages) names, or inside one of them."""
    module = function.partition(":")[0]
    return any(module == a or module.startswith(a + ".")
               for a in (part.strip() for part in allowed.split(",")) if a)


@router.post("", status_code=201, response_model=DatasetOut,
             responses={200: {"model": DatasetOut,
                              "description": "The name already holds this content hash."},
                        404: ERROR_RESPONSES[422] | {"description": "An unknown run."},
                        429: ERROR_RESPONSES[429] | {
                            "description": "The project runs its derivations' budget "
                            "(TRAJSTORE_API_DERIVE_PROJECT_RUNNING) already."}})
def derive(body: DatasetDerive, key: IngestKey, ctx: Ctx, response: Response) -> DatasetOut:
    """Derive a version of dataset ``name`` from the episodes of ``runs`` under ``rules``,
    by replaying their events (no model is called). 201 with a new version; 200 with the
    existing one when the name already holds a version of the same content hash; either way
    ``from_projection`` and ``replayed`` say how many of the runs' episodes took their
    samples from their projection and how many were replayed. 404 for an
    unknown run, 403 for another project's or for a reward function whose module the
    server's ``api_dataset_reward_modules`` does not name; 422 naming the field for a bad
    rule, a reward function that cannot be imported, that raises or returns no finite
    number (naming the episode), or rules that select nothing (saying how many episodes each
    rule left out). 429 naming ``TRAJSTORE_API_DERIVE_PROJECT_RUNNING`` while the project
    runs that many derivations in this process already (``api.derive_slots``: the episodes
    are replayed on the API's derivation processes). Nothing is written on any error."""
    for run_id in body.runs:
        ctx.access.check_run(key, run_id)
    function = body.rules.reward.function
    if function is not None and not _reward_module_allowed(
            function, ctx.settings.api_dataset_reward_modules):
        raise ApiError(403, "forbidden", f"this server lets a derivation over REST call "
                       f"reward functions of the modules TRAJSTORE_API_DATASET_REWARD_MODULES "
                       f"names only, and {function!r} is not among them",
                       field="body.rules.reward.function")
    try:
        with ctx.derives.slot(key.project) as pool:
            made = derive_dataset(ctx.store, body.name, body.runs, body.rules,
                                  project=key.project, pool=pool)
    except store_errors.NotFoundError as exc:
        raise ApiError(404, "not_found", str(exc)) from None
    except store_errors.ValidationError as exc:
        if exc.from_database:
            raise
        field = f"body.{exc.field}" if exc.field else "body"
        raise ApiError(422, "invalid_request", exc.reason, field=field) from None
    if not made.created:
        response.status_code = 200
    return dataset_out(made.version, created=made.created,
                       from_projection=made.from_projection, replayed=made.replayed)


@router.get("", response_model=DatasetList)
def list_datasets(key: ReadKey, ctx: Ctx) -> DatasetList:
    """Every version of every dataset of the key's project, by name then version."""
    return DatasetList(datasets=[dataset_out(v)
                                 for v in list_versions(ctx.store.db, key.project)])


@router.get("/diff", response_model=DatasetDiffOut)
def diff(key: ReadKey, ctx: Ctx,
         a: Annotated[str, Query(min_length=1, max_length=120,
                                 pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*(@[0-9]{1,9})?$",
                                 description="name@version (name alone: its latest)")],
         b: Annotated[str, Query(min_length=1, max_length=120,
                                 pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*(@[0-9]{1,9})?$",
                                 description="name@version (name alone: its latest)")],
         ) -> DatasetDiffOut:
    """Compare versions ``a`` and ``b``: rows added, removed and changed, and the shift of
    mean rewards and advantages, overall and per failure type. 404 naming the version that
    does not exist."""
    for label, ref in (("a", a), ("b", b)):
        try:
            parse_ref(ref)
        except store_errors.ValidationError as exc:
            raise ApiError(422, "invalid_request", exc.reason, field=f"query.{label}") from None
    return DatasetDiffOut.model_validate(diff_datasets(ctx.store.db, key.project, a, b)
                                         .to_dict())


@router.get("/{dataset}", response_model=DatasetList)
def versions(dataset: DatasetName, key: ReadKey, ctx: Ctx) -> DatasetList:
    """Every version of one dataset, oldest first; 404 when the name has none."""
    found = list_versions(ctx.store.db, key.project, dataset)
    if not found:
        raise ApiError(404, "not_found", f"no dataset {dataset!r}")
    return DatasetList(datasets=[dataset_out(v) for v in found])


@router.get("/{dataset}/versions/{version}", response_model=DatasetOut)
def show(dataset: DatasetName, version: Version, key: ReadKey, ctx: Ctx) -> DatasetOut:
    """One version: rules, runs, code version, content hash, counts, what trained it."""
    return dataset_out(_found(ctx, key.project, dataset, version))


@router.get("/{dataset}/versions/{version}/rows", response_model=DatasetRows)
def rows(dataset: DatasetName, version: Version, key: ReadKey, ctx: Ctx,
         offset: Annotated[int, Query(ge=0, le=2_147_483_647)] = 0,
         limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> DatasetRows:
    """A page of a version's rows in order, with tokens, masks and logprobs as lists."""
    found = _found(ctx, key.project, dataset, version)
    page = read_rows(ctx.store.db, found.dataset_id, offset=offset, limit=limit)
    out = [DatasetRowOut(row_index=offset + i, run_id=r.run_id, group_id=r.group_id,
                         episode_id=r.episode_id, agent=r.agent, kind=r.kind,
                         timeline_index=r.timeline_index, prompt_length=r.prompt_length,
                         reward=r.reward, advantage=r.advantage, failure_type=r.failure_type,
                         error_types=r.error_types, token_ids=r.token_ids.tolist(),
                         loss_mask=r.loss_mask.tolist(), logprobs=r.logprobs.tolist(),
                         row_hash=r.row_hash) for i, r in enumerate(page)]
    end = offset + len(out)
    return DatasetRows(rows=out, next_offset=end if end < found.num_rows else None)


@router.delete("/{dataset}/versions/{version}", status_code=204,
               responses={409: ERROR_RESPONSES[422]
                          | {"description": "A training step trained it."}})
def delete(dataset: DatasetName, version: Version, key: AdminKey, ctx: Ctx) -> Response:
    """Delete a version with its rows; 409 while a training step that trained it is
    recorded. A version is never changed: deriving again makes a new one."""
    try:
        delete_version(ctx.store.db, key.project, dataset, version)
    except store_errors.NotFoundError as exc:
        raise ApiError(404, "not_found", str(exc)) from None
    except store_errors.RefusedError as exc:
        raise ApiError(409, "dataset_trained", str(exc)) from None
    return Response(status_code=204)


@router.get("/{dataset}/versions/{version}/export", response_class=StreamingResponse,
            responses={200: {"content": {PARQUET_MEDIA_TYPE: {},
                                         exports.SAFETENSORS_MEDIA_TYPE: {},
                                         exports.JSONL_MEDIA_TYPE: {}},
                             "description": "The export, streamed (Parquet, safetensors or "
                                            "JSON lines, by format)."}})
def export(dataset: DatasetName, version: Version, key: ReadKey, ctx: Ctx,
           format: exports.ExportFormat = "samples",  # noqa: A002 - the query parameter
           group_id: str | None = None,
           kind: Annotated[str | None, Query(pattern="^(positive|negative)$")] = None,
           min_reward: float | None = None, data_source: str | None = None,
           pad_token_id: Annotated[int | None, Query(ge=0)] = None) -> StreamingResponse:
    """A version in any of the run export formats (docs/exports.md), built from its rows
    (samples, verl-batch: the rewards its rules gave) or its episodes' logs (verl-prompts,
    atif, sft): the same bytes as the run's export of the same samples. 404 for an unknown
    version, 422 for an option the format does not take, 429 naming
    ``TRAJSTORE_API_EXPORT_PROJECT_RUNNING`` while the project streams that many exports."""
    found = _found(ctx, key.project, dataset, version)
    give_back = ctx.exports.take(key.project, ctx.settings.api_export_project_running)
    try:
        made = exports.prepare_dataset(
            ctx.store, found, format, group_id=group_id, kind=kind, min_reward=min_reward,
            data_source=data_source, pad_token_id=pad_token_id,
            rows_per_group=ctx.settings.api_export_rows_per_group)
    except BaseException:
        give_back()
        raise
    return StreamingResponse(
        Held(made.chunks, give_back), media_type=made.media_type,
        headers={"Content-Disposition": f'attachment; filename="{made.filename}"'})
