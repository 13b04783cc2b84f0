"""Runs: creating one, and what a run looks like."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from store.arguments import RealNumber
from store.events import RunConfig

__all__ = ["EngineTakeupOut", "PolicyServedIn", "PolicyServedOut", "PolicyTakeup",
           "RunCreate", "RunCreated", "RunList", "RunOut", "VersionTakeupOut"]


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
    excluded: dict[str, int] = Field(
        default_factory=dict,
        description="Episodes and samples that did not reach training, per category of the "
                    "exclusions view (no_reward: episodes waiting for a reward); filled for "
                    "one run (GET /v1/runs/{run_id}), empty in listings.")
    policy_version: int = Field(description="Newest policy_updated version (0: none).")


class RunList(BaseModel):
    runs: list[RunOut]


class PolicyServedIn(BaseModel):
    """A rollout engine reports the policy version it now serves (``policy_served``)."""

    model_config = ConfigDict(extra="forbid")

    version: StrictInt = Field(ge=0, description="The policy version the engine loaded; one "
                                                 "the run recorded (0: the base weights).")
    engine: StrictStr = Field(min_length=1, max_length=200,
                              description="A stable id of the engine (host:pid/backend, or "
                                          "a server's address).",
                              examples=["rollout-3:4121/AsyncVLLMBackend"])
    backend: StrictStr = Field(min_length=1, max_length=100, examples=["AsyncVLLMBackend"])
    source: StrictStr | None = Field(default=None, max_length=2000,
                                     description="Where the weights came from: the "
                                                 "checkpoint folder or URL, 'push', a route.")
    load_seconds: RealNumber | None = Field(default=None, ge=0, allow_inf_nan=False,
                                       description="How long loading took.")


class PolicyServedOut(BaseModel):
    run_id: str
    version: int = Field(description="Version of the run's stream after the append.")
    position: int = Field(description="Position of the policy_served event in the log.")


class EngineTakeupOut(BaseModel):
    engine: str
    backend: str
    served_at: dt.datetime
    lag_seconds: float | None = Field(description="From the version's policy_updated to the "
                                                  "engine's report (None for version 0).")
    load_seconds: float | None
    source: str | None


class VersionTakeupOut(BaseModel):
    version: int
    step: int | None
    updated_at: dt.datetime | None = Field(description="When policy_updated was recorded "
                                                       "(None for version 0).")
    lag_max_seconds: float | None
    engines: list[EngineTakeupOut]


class PolicyTakeup(BaseModel):
    run_id: str
    versions: list[VersionTakeupOut] = Field(description="Oldest first.")
    serving: dict[str, int] = Field(description="The highest version each engine reported.")
