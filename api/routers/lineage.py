"""Lineage (docs/datasets.md): what fed a training step, which steps trained an episode
(``read``). Both read the indexed ``step_samples`` table (``store.lineage``)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from api.deps import Ctx, ReadKey
from api.errors import ERROR_RESPONSES
from api.schemas.lineage import (
    EpisodeLineageOut,
    EpisodeStepOut,
    StepLineageOut,
    StepSampleOut,
    StepVersionOut,
)
from store.lineage import episode_lineage, step_lineage

__all__ = ["router"]

router = APIRouter(tags=["lineage"], responses=ERROR_RESPONSES)

Step = Annotated[int, Path(ge=0, le=2_147_483_647)]


@router.get("/v1/runs/{run_id}/steps/{step}/lineage", response_model=StepLineageOut)
def step_samples(run_id: str, step: Step, key: ReadKey, ctx: Ctx) -> StepLineageOut:
    """What fed step ``step`` of the run: the samples it trained (ids, episodes, rewards) and
    the dataset version they came from (null: the run's own projection). 404 naming the run
    for an unknown run, naming the step when the run recorded no such step, and saying so
    when the step was recorded without its samples; 403 for another project's run."""
    ctx.access.check_run(key, run_id)
    versions = step_lineage(ctx.store.db, run_id, step)
    return StepLineageOut(
        run_id=run_id, step=step,
        versions=[StepVersionOut(policy_version=v.policy_version, dataset_id=v.dataset_id,
                                 samples=[StepSampleOut(position=s.position,
                                                        sample_id=s.sample_id,
                                                        episode_id=s.episode_id,
                                                        reward=s.reward)
                                          for s in v.samples])
                  for v in versions],
        episode_ids=list(dict.fromkeys(e for v in versions for e in v.episode_ids)))


@router.get("/v1/episodes/{episode_id}/lineage", response_model=EpisodeLineageOut)
def episode_steps(episode_id: str, key: ReadKey, ctx: Ctx) -> EpisodeLineageOut:
    """The training steps that trained samples of the episode, by run and policy version
    (empty when none did yet). 404 naming the episode for an unknown one, 403 for another
    project's."""
    ctx.access.check_episode(key, episode_id)
    steps = episode_lineage(ctx.store.db, episode_id)
    return EpisodeLineageOut(episode_id=episode_id, steps=[EpisodeStepOut(
        run_id=s.run_id, step=s.step, policy_version=s.policy_version,
        dataset_id=s.dataset_id, sample_ids=list(s.sample_ids), rewards=list(s.rewards))
        for s in steps])
