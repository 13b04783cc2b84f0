"""Lineage: which samples each training step trained, and which steps trained an episode.

A trainer's ``policy_updated`` carries ``trained`` (``store.events.TrainedSamples``): the ids
of the samples the step trained, their episodes, the rewards they were trained with, and the
dataset version they came from (None: the run's own projection). The database copies them
into ``step_samples`` in the transaction that inserts the event (migration 0016), so the
lineage of a step is recorded exactly when the step is. Two indexed queries read it:

- :func:`step_lineage`: what fed step k of run R (``step_samples_step_idx``);
- :func:`episode_lineage`: which steps trained episode e (``step_samples_episode_idx``).

A step is named by its ``step`` number as its ``policy_updated`` recorded it (the trainer's
optimizer steps so far); two trainers of one run may record the same number under two
policy versions, so a step's lineage is grouped by policy version.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from psycopg.rows import dict_row

from store import errors
from store.arguments import whole_number
from store.db import Database
from store.stream_rules import run_stream_id

__all__ = ["EpisodeStep", "StepLineage", "StepSample", "dataset_project", "episode_lineage",
           "recorded_steps", "sample_rows", "step_lineage", "STEP_QUERY", "EPISODE_QUERY"]


@dataclass(frozen=True)
class StepSample:
    """One sample a step trained: its position in the batch, its id (the projection's
    ``sample_id``, or the dataset version's row index), its episode and the reward it was
    trained with."""

    position: int
    sample_id: int
    episode_id: str
    reward: float


@dataclass(frozen=True)
class StepLineage:
    """What fed one recorded step: the policy version it recorded, the dataset version it
    trained (None: the run's own projection) and its samples in batch order."""

    run_id: str
    step: int
    policy_version: int
    dataset_id: int | None
    samples: tuple[StepSample, ...]

    @property
    def episode_ids(self) -> tuple[str, ...]:
        """The episodes of the step's samples, each once, in batch order."""
        return tuple(dict.fromkeys(s.episode_id for s in self.samples))


@dataclass(frozen=True)
class EpisodeStep:
    """One step that trained samples of an episode: its run, step, policy version, dataset
    version (None: the run's own projection), and the episode's samples in it."""

    run_id: str
    step: int
    policy_version: int
    dataset_id: int | None
    sample_ids: tuple[int, ...]
    rewards: tuple[float, ...]


#: What fed step ``step`` of ``run``: an index range scan of ``step_samples_step_idx``.
STEP_QUERY = ("SELECT policy_version, position, sample_id, episode_id, reward, dataset_id"
              " FROM step_samples WHERE run_id = %(run)s AND step = %(step)s"
              " ORDER BY policy_version, position")

#: Which steps trained ``episode``: an index scan of ``step_samples_episode_idx``.
EPISODE_QUERY = ("SELECT run_id, step, policy_version, position, sample_id, reward, dataset_id"
                 " FROM step_samples WHERE episode_id = %(episode)s"
                 " ORDER BY run_id, policy_version, position")


def _text(name: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    return value


def sample_rows(db: Database, sample_ids: list[int]) -> dict[int, dict[str, Any]]:
    """The ``samples`` rows (every column, tokens as bytes) of ``sample_ids`` the run's
    projection still holds, by sample id (a step's samples, to replay it)."""
    with db.connection() as conn:
        return {r["sample_id"]: r for r in conn.cursor(row_factory=dict_row).execute(
            "SELECT * FROM samples WHERE sample_id = ANY(%s)", (sample_ids,)).fetchall()}


def recorded_steps(steps: Sequence[int]) -> str:
    """The tail of a "recorded no step K" error: the steps the run did record (a step is the
    trainer's optimizer step that ``policy_updated`` records, several per policy version
    when an update runs mini-batches), the middle of a long list elided."""
    if not steps:
        return "; it recorded no training step yet"
    ordered = sorted(steps)
    shown = [str(s) for s in ordered] if len(ordered) <= 12 else \
        [*map(str, ordered[:6]), "...", *map(str, ordered[-3:])]
    return f"; the steps it recorded: {', '.join(shown)}"


def step_lineage(db: Database, run_id: str, step: int) -> list[StepLineage]:
    """What fed step ``step`` of run ``run_id``: one entry per policy version that step
    recorded (one, unless two trainers of the run raced), oldest version first.
    ``NotFoundError`` naming the run when there is no such run, naming the step when the run
    recorded no step ``step``, and saying so when the step was recorded without its samples
    (by a trainer before lineage). ValueError for an empty ``run_id`` or a negative or
    non-integer ``step``."""
    _text("run_id", run_id)
    whole_number("step", step, minimum=0)
    with db.connection() as conn:
        rows = conn.execute(STEP_QUERY, {"run": run_id, "step": step}).fetchall()
        if not rows:
            stream = run_stream_id(run_id)
            if conn.execute("SELECT 1 FROM events WHERE stream_id = %s AND type = 'run_created'",
                            (stream,)).fetchone() is None:
                raise errors.NotFoundError(f"no run {run_id!r}")
            steps = [r[0] for r in conn.execute(
                "SELECT DISTINCT (data->>'step')::integer FROM events WHERE stream_id = %s"
                " AND type = 'policy_updated' AND data->>'step' IS NOT NULL ORDER BY 1",
                (stream,)).fetchall()]
            if step not in steps:
                raise errors.NotFoundError(
                    f"run {run_id!r} recorded no step {step}{recorded_steps(steps)}")
            raise errors.NotFoundError(f"step {step} of run {run_id!r} was recorded without "
                                       "the samples it trained")
    out: dict[int, list[tuple[int, StepSample]]] = {}
    for version, position, sample_id, episode_id, reward, dataset_id in rows:
        out.setdefault(version, []).append(
            (dataset_id, StepSample(position, sample_id, episode_id, reward)))
    return [StepLineage(run_id=run_id, step=step, policy_version=version,
                        dataset_id=group[0][0], samples=tuple(s for _, s in group))
            for version, group in out.items()]


def episode_lineage(db: Database, episode_id: str) -> list[EpisodeStep]:
    """Every recorded step that trained samples of episode ``episode_id``, by run and policy
    version; empty when none did yet. ``NotFoundError`` naming the episode when there is no
    such episode (no ``episode_started`` stream). ValueError for an empty id."""
    _text("episode_id", episode_id)
    with db.connection() as conn:
        rows = conn.execute(EPISODE_QUERY, {"episode": episode_id}).fetchall()
        if not rows and conn.execute(
                "SELECT 1 FROM events WHERE stream_id = %s AND stream_version = 1"
                " AND type = 'episode_started'", (episode_id,)).fetchone() is None:
            raise errors.NotFoundError(f"no episode {episode_id!r}")
    steps: dict[tuple[str, int], EpisodeStep] = {}
    for run_id, step, version, _position, sample_id, reward, dataset_id in rows:
        key = (run_id, version)
        seen = steps.get(key)
        if seen is None:
            steps[key] = EpisodeStep(run_id=run_id, step=step, policy_version=version,
                                     dataset_id=dataset_id, sample_ids=(sample_id,),
                                     rewards=(reward,))
        else:
            steps[key] = EpisodeStep(run_id=run_id, step=step, policy_version=version,
                                     dataset_id=dataset_id,
                                     sample_ids=(*seen.sample_ids, sample_id),
                                     rewards=(*seen.rewards, reward))
    return list(steps.values())


def dataset_project(db: Database, dataset_id: int) -> str | None:
    """The project of dataset version ``dataset_id`` (None: no such version), for checking
    a ``policy_updated`` that names it before it is appended."""
    with db.connection() as conn:
        row = conn.execute("SELECT project FROM datasets WHERE dataset_id = %s",
                           (dataset_id,)).fetchone()
    return None if row is None else str(row[0])
