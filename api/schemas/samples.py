"""Samples and leased batches: the columns a verl trainer reads.

``prompt_ids`` are the tokens before the first trainable one, ``response_ids`` the rest (later
context included, masked out by ``response_mask``), ``rollout_log_probs`` the engine's
logprobs of the response tokens (0 where not sampled), ``uid`` the GRPO group,
``is_negative`` marks failed attempts kept as negative samples.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from api.schemas.common import FloatArray, IntArray
from store.arguments import RealNumber

__all__ = [
    "AckOut",
    "AckRequest",
    "LeaseOut",
    "LeaseRequest",
    "ReleaseOut",
    "RenewOut",
    "RenewRequest",
    "SampleOut",
    "SamplePage",
]


class SampleOut(BaseModel):
    sample_id: int
    uid: str = Field(description="The GRPO group id.")
    episode_id: str
    agent: str
    kind: Literal["positive", "negative"]
    is_negative: bool
    status: str | None = Field(default=None, description="ready, leased, consumed, stale, "
                                                         "skipped")
    reward: float | None
    policy_version: int | None
    prompt_length: int
    num_tokens: int
    num_trainable: int | None = None
    error_types: list[str] | None = None
    error_messages: list[str] | None = None
    prompt_ids: IntArray | None = None
    response_ids: IntArray | None = None
    response_mask: IntArray | None = None
    rollout_log_probs: FloatArray | None = None


class SamplePage(BaseModel):
    samples: list[SampleOut]
    next_cursor: str | None


class LeaseRequest(BaseModel):
    """Lease up to ``groups`` complete groups for ``lease_seconds``. ``format`` picks the
    answer: JSON (``LeaseOut``) or a Parquet file with the export's columns and the lease in
    ``X-Trajstore-Lease-*`` headers."""

    model_config = ConfigDict(extra="forbid")

    groups: StrictInt = Field(default=1, ge=1, le=4096)
    lease_seconds: RealNumber = Field(default=600.0, gt=0, le=7 * 24 * 3600)
    max_staleness: StrictInt | None = Field(default=None, ge=0, le=2**31 - 1)
    current_version: StrictInt | None = Field(default=None, ge=0, le=2**31 - 1)
    trainer: str | None = Field(default=None, max_length=200)
    format: Literal["json", "parquet"] = "json"
    encoding: Literal["json", "base64"] = "json"


class LeaseOut(BaseModel):
    lease_id: uuid.UUID
    run_id: str
    groups: list[str]
    expires_at: dt.datetime
    skipped_stale: int
    samples: list[SampleOut]


class AckRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    policy_version: StrictInt = Field(ge=0, le=2**31 - 1,
                                      description="The policy version trained on the batch.")


class AckOut(BaseModel):
    lease_id: uuid.UUID
    consumed: int


class ReleaseOut(BaseModel):
    lease_id: uuid.UUID
    released: int


class RenewRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lease_seconds: RealNumber = Field(gt=0, le=7 * 24 * 3600)


class RenewOut(BaseModel):
    lease_id: uuid.UUID
    expires_at: dt.datetime
