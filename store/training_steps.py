"""Training steps as data: the ``training_steps`` view (migration 0009), one row per
``policy_updated`` with the version gap of the samples the step trained, the samples skipped as
too stale, and what the off-policy correction did."""

from __future__ import annotations

import dataclasses
import datetime as dt
from dataclasses import dataclass

from store.db import Database

__all__ = ["TrainingStep", "training_steps"]


@dataclass(frozen=True)
class TrainingStep:
    """One ``policy_updated``. Metrics the step did not record are None."""

    run_id: str
    policy_version: int
    step: int | None
    samples: int | None
    episodes: int | None
    skipped_stale: int | None
    version_gap_min: float | None
    version_gap_mean: float | None
    version_gap_max: float | None
    correction_ratio_mean: float | None
    correction_ratio_max: float | None
    correction_clipped_frac: float | None
    correction_rejected_frac: float | None
    correction_kl: float | None
    uncorrected_samples: int | None
    reward_mean: float | None
    occurred_at: dt.datetime


_COLUMNS = ", ".join(f.name for f in dataclasses.fields(TrainingStep))


def training_steps(db: Database, run_id: str, *, limit: int = 1000) -> list[TrainingStep]:
    """The run's training steps, newest policy version first, at most ``limit``. An unknown
    run gives no rows. Raises ValueError for an empty ``run_id`` or ``limit`` < 1."""
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"run_id must be a non-empty string, got {run_id!r}")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be a positive integer, got {limit!r}")
    with db.connection() as conn:
        rows = conn.execute(
            f"SELECT {_COLUMNS} FROM analytics_training_steps(run => %s) "  # noqa: S608
            "ORDER BY policy_version DESC LIMIT %s", (run_id, limit)).fetchall()
    return [TrainingStep(*row) for row in rows]
