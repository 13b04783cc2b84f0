"""Datasets: deriving a version, what a version looks like, its rows, a comparison."""

from __future__ import annotations

import datetime as dt
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from workers.datasets.rules import DatasetRules

__all__ = ["DatasetDerive", "DatasetDiffOut", "DatasetList", "DatasetOut", "DatasetRowOut",
           "DatasetRows", "RowKey", "ShiftOut"]


class DatasetDerive(BaseModel):
    """Derive a version of dataset ``name`` from the episodes of ``runs`` (runs of the key's
    project) under ``rules`` (every rule defaults to the runs' own projection)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                      examples=["gsm8k-last-turn"])
    runs: list[str] = Field(min_length=1, max_length=100)
    rules: DatasetRules = Field(default_factory=DatasetRules)


class DatasetOut(BaseModel):
    """One version of a dataset. ``created``: on a derive, False when the name already held
    a version of the same content hash (nothing was written). ``from_projection`` and
    ``replayed``: on a derive, how many of the runs' episodes took their samples from their
    current projection and how many were read from their events whole (replayed unless
    left out before replay); null elsewhere."""

    name: str
    version: int
    project: str
    content_hash: str = Field(description="sha256 of the rows, the rules and the code "
                                          "version that built them.")
    rules: dict[str, Any]
    run_ids: list[str]
    code_version: str
    rows: int
    episodes: int
    excluded: dict[str, int] = Field(description="Episodes of the runs left out, by reason.")
    created_at: dt.datetime
    trained_by: list[dict[str, Any]] = Field(
        default_factory=list, description="Training steps that trained this version.")
    created: bool | None = None
    from_projection: int | None = Field(
        default=None, description="On a derive: episodes whose samples were taken from "
        "their current projection.")
    replayed: int | None = Field(
        default=None, description="On a derive: episodes read from their events whole "
        "(replayed unless left out before replay).")


class DatasetList(BaseModel):
    datasets: list[DatasetOut]


class DatasetRowOut(BaseModel):
    """One row: its key (episode, kind, timeline index), its tokens, loss mask and rollout
    logprobs (one entry per token), reward, advantage (null unless computed)."""

    row_index: int
    run_id: str
    group_id: str
    episode_id: str
    agent: str
    kind: str
    timeline_index: int
    prompt_length: int
    reward: float
    advantage: float | None
    failure_type: str | None
    error_types: list[str] | None
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    row_hash: str


class DatasetRows(BaseModel):
    rows: list[DatasetRowOut]
    next_offset: int | None


class RowKey(BaseModel):
    episode_id: str
    kind: str
    timeline_index: int


class ShiftOut(BaseModel):
    a: float | None
    b: float | None
    shift: float | None
    rows_a: int
    rows_b: int


class DatasetDiffOut(BaseModel):
    """Rows added (in b only), removed (in a only), changed (same key, other content) and
    unchanged; the shift of the mean reward (and advantage, when both versions have them)
    overall and per failure type (``none``: rows that met no failure)."""

    a: dict[str, Any]
    b: dict[str, Any]
    added: list[RowKey]
    removed: list[RowKey]
    changed: list[RowKey]
    unchanged: int
    reward: ShiftOut
    advantage: ShiftOut | None
    by_failure_type: dict[str, dict[str, ShiftOut | None]]
