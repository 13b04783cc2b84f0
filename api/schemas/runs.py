"""Runs: creating one, and what a run looks like."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from store.events import RunConfig

__all__ = ["RunCreate", "RunCreated", "RunOut", "RunList"]


class RunCreate(BaseModel):
    """A new run. ``project`` may be left out (the key's project is used); naming another
    project is refused with 403. ``event_id`` makes a retried create idempotent."""

    model_config = ConfigDict(extra="forbid")

    run_id: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_.:\-]+$",
                        examples=["gsm8k-qwen3-egpo"])
    project: str | None = Field(default=None, min_length=1, max_length=200)
    config: RunConfig = Field(default_factory=RunConfig,
                              description="Group size, EGPO λ/α/variant, merge policy, "
                                          "rollback and negative-sample settings, tokenizer.")
    event_id: uuid.UUID | None = None


class RunCreated(BaseModel):
    run_id: str
    project: str
    version: int = Field(description="Version of the run's stream after the append.")
    position: int = Field(description="Position of the run_created event in the log.")
    duplicate: bool = Field(description="True when this was a retry of a stored create.")


class RunOut(BaseModel):
    run_id: str
    project: str
    config: dict[str, Any]
    created_at: dt.datetime
    version: int = Field(description="Version of the run's own stream (policy updates).")
    episodes: dict[str, int] = Field(
        description="'started' (from the log) and, per status, episodes replayed.")
    samples: dict[str, int] = Field(description="Samples by lease status.")
    policy_version: int = Field(description="Newest policy_updated version (0: none).")


class RunList(BaseModel):
    runs: list[RunOut]
