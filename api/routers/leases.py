"""Batches over HTTP, for trainers that cannot reach the database: lease complete groups,
acknowledge them after the optimizer step, release them untrained, renew a long step.
Leasing changes what other trainers get, so every route needs a ``train`` (or ``admin``) key.
Leases and their expiry are the store's (``store.leasing``)."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse

from api import verl_columns
from api.deps import Ctx, TrainKey
from api.errors import ERROR_RESPONSES
from api.parquet import PARQUET_MEDIA_TYPE, parquet_bytes
from api.schemas.samples import (
    AckOut,
    AckRequest,
    LeaseOut,
    LeaseRequest,
    ReleaseOut,
    RenewOut,
    RenewRequest,
)
from store.leasing import Lease

__all__ = ["router"]

router = APIRouter(tags=["leases"], responses=ERROR_RESPONSES)

_ENDED = ERROR_RESPONSES[422] | {"description": "The lease ended before this call (expired, "
                                                "released or acknowledged)."}


@router.post(
    "/v1/runs/{run_id}/leases", response_model=LeaseOut,
    responses={200: {"content": {PARQUET_MEDIA_TYPE: {}},
                      "description": "The batch (JSON, or Parquet with the lease in "
                                     "X-Trajstore-Lease-* headers)."},
               204: {"description": "No complete group is ready."}})
def lease_batch(run_id: str, body: LeaseRequest, key: TrainKey, ctx: Ctx) -> Response:
    """Lease up to ``groups`` complete groups (every episode of the group replayed, with its
    negatives up to the run's cap) for ``lease_seconds``."""
    ctx.access.check_run(key, run_id)
    built: list[Response] = []

    def build(lease: Lease) -> None:
        # Runs before the lease commits: a body that cannot be built rolls the lease back.
        if lease.samples:
            built.append(_lease_response(lease, body))

    lease = ctx.leasing.lease_batch(
        run_id, groups=body.groups, lease_seconds=body.lease_seconds,
        max_staleness=body.max_staleness, current_version=body.current_version,
        trainer=body.trainer, prepare=build)
    if lease is None or not lease.samples or not built:
        headers = {"X-Trajstore-Skipped-Stale": str(lease.skipped_stale if lease else 0)}
        return Response(status_code=204, headers=headers)
    return built[0]


def _lease_response(lease: Lease, body: LeaseRequest) -> Response:
    """The answer reporting ``lease``: Parquet with the lease in headers, or JSON."""
    samples = [verl_columns.from_leased(s) for s in lease.samples]
    if body.format == "parquet":
        data = parquet_bytes([verl_columns.record_batch(samples)], verl_columns.ARROW_SCHEMA)
        return Response(data, media_type=PARQUET_MEDIA_TYPE, headers={
            "X-Trajstore-Lease-Id": str(lease.lease_id),
            "X-Trajstore-Lease-Expires": lease.expires_at.isoformat(),
            "X-Trajstore-Lease-Groups": ",".join(lease.groups),
            "X-Trajstore-Skipped-Stale": str(lease.skipped_stale),
        })
    out = LeaseOut.model_validate({
        "lease_id": lease.lease_id, "run_id": lease.run_id, "groups": lease.groups,
        "expires_at": lease.expires_at, "skipped_stale": lease.skipped_stale,
        "samples": [verl_columns.to_json(s, encoding=body.encoding) for s in samples],
    })
    return JSONResponse(out.model_dump(mode="json"))


@router.post("/v1/leases/{lease_id}/ack", response_model=AckOut, responses={409: _ENDED})
def ack_lease(lease_id: uuid.UUID, body: AckRequest, key: TrainKey, ctx: Ctx) -> AckOut:
    """Mark the lease's samples consumed by ``policy_version`` (acknowledging twice is
    harmless); 409 when the lease expired or was released first."""
    ctx.access.check_lease(key, lease_id)
    return AckOut(lease_id=lease_id,
                  consumed=ctx.leasing.ack(lease_id, policy_version=body.policy_version))


@router.post("/v1/leases/{lease_id}/release", response_model=ReleaseOut,
             responses={409: _ENDED})
def release_lease(lease_id: uuid.UUID, key: TrainKey, ctx: Ctx) -> ReleaseOut:
    """Give the lease's samples back untrained."""
    ctx.access.check_lease(key, lease_id)
    return ReleaseOut(lease_id=lease_id, released=ctx.leasing.release(lease_id))


@router.post("/v1/leases/{lease_id}/renew", response_model=RenewOut, responses={409: _ENDED})
def renew_lease(lease_id: uuid.UUID, body: RenewRequest, key: TrainKey, ctx: Ctx) -> RenewOut:
    """Extend a live lease to ``lease_seconds`` from now."""
    ctx.access.check_lease(key, lease_id)
    return RenewOut(lease_id=lease_id,
                    expires_at=ctx.leasing.renew(lease_id, body.lease_seconds))
