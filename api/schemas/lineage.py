"""Lineage: the samples a training step trained, and the steps that trained an episode."""

from __future__ import annotations

from pydantic import BaseModel

__all__ = ["EpisodeLineageOut", "EpisodeStepOut", "StepLineageOut", "StepSampleOut",
           "StepVersionOut"]


class StepSampleOut(BaseModel):
    """One sample of a step: its position in the batch, its id (the projection's sample id,
    or the row index of the dataset version), its episode and the reward it trained with."""

    position: int
    sample_id: int
    episode_id: str
    reward: float


class StepVersionOut(BaseModel):
    """The policy version a step recorded, the dataset version it trained (null: the run's
    own projection) and its samples in batch order."""

    policy_version: int
    dataset_id: int | None
    samples: list[StepSampleOut]


class StepLineageOut(BaseModel):
    """What fed step ``step`` of run ``run_id``: one entry per policy version recorded under
    that step number (one, unless two trainers raced), and the episodes of its samples."""

    run_id: str
    step: int
    versions: list[StepVersionOut]
    episode_ids: list[str]


class EpisodeStepOut(BaseModel):
    """One step that trained samples of the episode."""

    run_id: str
    step: int
    policy_version: int
    dataset_id: int | None
    sample_ids: list[int]
    rewards: list[float]


class EpisodeLineageOut(BaseModel):
    """The steps that trained the episode, by policy version (empty: none yet)."""

    episode_id: str
    steps: list[EpisodeStepOut]
