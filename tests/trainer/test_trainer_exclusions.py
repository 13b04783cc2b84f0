"""Exclusion records: episodes and samples that did not reach training, each with one
category of the taxonomy, from the ``exclusions`` view, and on the episode page."""

from __future__ import annotations

import html
import re
import uuid
from pathlib import Path

import pytest
import trainer_episodes
from fastapi.testclient import TestClient
from trainer_episodes import new_run, record_group

from api.app import create_app
from api.keys import KeyStore
from store.eventlog import NO_STREAM
from store.events import EpisodeFinished, EpisodeStarted
from store.training_steps import EXCLUSION_CATEGORIES, exclusions
from workers.engines.backend_transformers import TransformersBackend
from workers.replay.jobs.project import project_episode
from workers.trainer.config import TrainerConfig
from workers.trainer.loop import Trainer

tiny_model = trainer_episodes.tiny_model
trainer_settings = trainer_episodes.trainer_settings
trainer_store = trainer_episodes.trainer_store


def _finished_without_samples(store, run_id: str, status: str, reason: str) -> str:
    episode_id = f"ep-{uuid.uuid4().hex[:8]}"
    store.append(episode_id, [
        EpisodeStarted(run_id=run_id, group_id=f"{run_id}:lone",
                       messages=[{"role": "user", "content": "hi"}]),
        EpisodeFinished(status=status, reason=reason)], NO_STREAM)
    project_episode(store, episode_id)
    return episode_id


def test_exclusions_name_why_nothing_trained(trainer_store, trainer_settings,
                                             tiny_model: Path) -> None:
    run_id = new_run(trainer_store, tiny_model, group_size=2)
    engine = TransformersBackend(tiny_model)
    for seed in (1, 2):
        record_group(trainer_store, engine, run_id, size=2, seed=seed)
    trainer = Trainer.open(trainer_store, run_id, config=TrainerConfig(
        lr=1e-3, groups_per_step=1, micro_batch_size=2, max_staleness=0))
    assert trainer.step().trained
    skipped = trainer.step()  # the other group is now one version old: too stale
    assert not skipped.trained and skipped.skipped_stale == 2

    timeout = _finished_without_samples(trainer_store, run_id, "aborted",
                                        "no event for 30 s: its worker is gone")
    infra = _finished_without_samples(trainer_store, run_id, "aborted", "redelivered")
    grader = _finished_without_samples(trainer_store, run_id, "error",
                                       "ValueError: the reward function raised")
    tool = _finished_without_samples(trainer_store, run_id, "error", "tool sandbox died")

    rows = exclusions(trainer_store.db, run_id=run_id)
    assert all(r.category in EXCLUSION_CATEGORIES for r in rows)
    by_episode = {r.episode_id: r.category for r in rows if r.sample_id is None}
    assert by_episode == {timeout: "timeout", infra: "infra", grader: "grader", tool: "tool"}
    stale = [r for r in rows if r.sample_id is not None]
    assert len(stale) == 2 and {r.category for r in stale} == {"stale"}
    assert {r.group_id for r in stale} == {f"{run_id}:g2"}

    assert [r.category for r in exclusions(trainer_store.db, episode_id=grader)] == ["grader"]
    assert exclusions(trainer_store.db, episode_id="no-such-episode") == []
    with pytest.raises(ValueError, match="run_id or episode_id"):
        exclusions(trainer_store.db)

    settings = trainer_settings.model_copy(update={"api_key_scrypt_n": 1024})
    token = KeyStore(trainer_store.db, settings).create(project="default", role="read").token
    with TestClient(create_app(settings, store=trainer_store)) as client:
        page = client.get(f"/ui/episodes/{stale[0].episode_id}",
                          headers={"Authorization": f"Bearer {token}"})
    assert page.status_code == 200, page.text
    body = re.search(r'id="exclusion-rows">.*?<tbody>(.*?)</tbody>', page.text, re.S)
    assert body
    first = [html.unescape(re.sub(r"<[^>]+>", "", c)).strip()
             for c in re.findall(r"<td[^>]*>(.*?)</td>", body.group(1), re.S)]
    assert first[:2] == ["stale", str(stale[0].sample_id)]
