"""Training steps as data: the ``training_steps`` view (migrations 0009 and 0011), one row per
``policy_updated`` with the version gap of the samples the step trained, the samples skipped as
too stale, what the off-policy correction did, the negative samples in the batch and EGPO's
entropy bonus."""

from __future__ import annotations

import dataclasses
import datetime as dt
from dataclasses import dataclass

from store.arguments import whole_number
from store.db import Database

__all__ = ["EXCLUSION_CATEGORIES", "Exclusion", "TrainingStep", "exclusion_counts", "exclusions",
           "training_steps"]


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
    negatives: int | None = None
    egpo_bonus_mean: float | None = None
    egpo_bonus_frac: float | None = None


_COLUMNS = ", ".join(f.name for f in dataclasses.fields(TrainingStep))


def training_steps(db: Database, run_id: str, *, limit: int = 1000) -> list[TrainingStep]:
    """The run's training steps, newest policy version first, at most ``limit``. An unknown
    run gives no rows. Raises ValueError for an empty ``run_id`` or ``limit`` < 1."""
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"run_id must be a non-empty string, got {run_id!r}")
    whole_number("limit", limit)
    with db.connection() as conn:
        rows = conn.execute(
            f"SELECT {_COLUMNS} FROM analytics_training_steps(run => %s) "  # noqa: S608
            "ORDER BY policy_version DESC LIMIT %s", (run_id, limit)).fetchall()
    return [TrainingStep(*row) for row in rows]


#: The exclusion taxonomy, in the order the docs list it.
EXCLUSION_CATEGORIES = ("infra", "grader", "format", "tool", "timeout", "truncated", "stale",
                        "capped", "rejected", "invalid", "no_reward")


@dataclass(frozen=True)
class Exclusion:
    """Why an episode (``sample_id`` None) or one of its samples did not reach training:
    ``category`` from :data:`EXCLUSION_CATEGORIES`, ``detail`` the text it came from."""

    run_id: str
    group_id: str
    episode_id: str
    sample_id: int | None
    policy_version: int | None
    category: str
    detail: str | None
    finished_at: dt.datetime | None


_EXCLUSION_COLUMNS = ", ".join(f.name for f in dataclasses.fields(Exclusion))


def exclusions(db: Database, *, run_id: str | None = None, episode_id: str | None = None,
               limit: int = 1000) -> list[Exclusion]:
    """Rows of the ``exclusions`` view for a run and/or one episode (at least one of them),
    ordered by episode then sample. Unknown ids give no rows. Raises ValueError when neither
    is given, for an empty id, or for ``limit`` < 1."""
    for name, value in (("run_id", run_id), ("episode_id", episode_id)):
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    if run_id is None and episode_id is None:
        raise ValueError("give run_id or episode_id")
    whole_number("limit", limit)
    with db.connection() as conn:
        if episode_id is not None:
            found = conn.execute("SELECT run_id FROM episodes WHERE episode_id = %s",
                                 (episode_id,)).fetchone()
            if found is None or (run_id is not None and found[0] != run_id):
                return []
            rows = conn.execute(
                f"SELECT {_EXCLUSION_COLUMNS} FROM analytics_exclusions(run => %s) "  # noqa: S608
                "WHERE episode_id = %s ORDER BY sample_id NULLS FIRST LIMIT %s",
                (found[0], episode_id, limit)).fetchall()
        else:
            rows = conn.execute(
                f"SELECT {_EXCLUSION_COLUMNS} FROM analytics_exclusions(run => %s) "  # noqa: S608
                "ORDER BY episode_id, sample_id NULLS FIRST LIMIT %s",
                (run_id, limit)).fetchall()
    return [Exclusion(*row) for row in rows]


def exclusion_counts(db: Database, run_id: str) -> dict[str, int]:
    """How many rows of the ``exclusions`` view the run has per category (every category of
    :data:`EXCLUSION_CATEGORIES`, zero when none): the run's count of episodes and samples
    that did not reach training, and why. An unknown run gives zeros. Raises ValueError for
    an empty ``run_id``."""
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"run_id must be a non-empty string, got {run_id!r}")
    with db.connection() as conn:
        rows = conn.execute(
            "SELECT category, count(*) FROM analytics_exclusions(run => %s) GROUP BY category",
            (run_id,)).fetchall()
    out = dict.fromkeys(EXCLUSION_CATEGORIES, 0)
    out.update({category: int(n) for category, n in rows})
    return out
