"""Off-policy correction and staleness inside a real training step: samples recorded under
version 0 and trained after an update carry a version gap of 1, a nonzero rollout/train KL,
and both appear in ``policy_updated``."""

from __future__ import annotations

import html
import re
from pathlib import Path

import trainer_episodes
from fastapi.testclient import TestClient
from trainer_episodes import new_run, record_group

from api.app import create_app
from api.keys import KeyStore
from store.eventlog import run_stream_id
from store.events import PolicyUpdated
from store.training_steps import training_steps
from workers.engines.backend_transformers import TransformersBackend
from workers.trainer.config import TrainerConfig
from workers.trainer.loop import Trainer, staleness_metrics

tiny_model = trainer_episodes.tiny_model
trainer_settings = trainer_episodes.trainer_settings
trainer_store = trainer_episodes.trainer_store


def test_stale_samples_are_corrected_and_their_gap_recorded(trainer_store, trainer_settings,
                                                            tiny_model: Path) -> None:
    run_id = new_run(trainer_store, tiny_model, group_size=4)
    engine = TransformersBackend(tiny_model)  # not attached: it keeps sampling version 0
    for seed in (1, 2, 3, 4):
        record_group(trainer_store, engine, run_id, size=4, seed=seed)
    trainer = Trainer.open(trainer_store, run_id, config=TrainerConfig(
        lr=5e-2, groups_per_step=2, micro_batch_size=4, max_staleness=1))

    fresh = trainer.step()
    stale = trainer.step()

    assert fresh.version == 1 and stale.version == 2
    # The first step trains what version 0 sampled: no gap, and the trainer's recomputation
    # agrees with the engine, so the correction is (numerically) the identity.
    assert fresh.metrics["version_gap_min"] == fresh.metrics["version_gap_max"] == 0.0
    assert abs(fresh.metrics["correction_ratio_mean"] - 1.0) < 1e-3
    assert fresh.metrics["correction_clipped_frac"] == 0.0
    assert fresh.metrics["correction_uncorrected_samples"] == 0.0
    # The second trains version-0 samples with version-1 weights.
    assert stale.metrics["version_gap_min"] == stale.metrics["version_gap_max"] == 1.0
    assert stale.metrics["version_gap_mean"] == 1.0
    assert abs(stale.metrics["correction_kl"]) > 1e-3
    assert stale.metrics["correction_ratio_max"] > 1.0
    assert stale.metrics["correction_k3_kl"] > 0.0

    recorded = [r.event for r in trainer_store.read_stream(run_stream_id(run_id))
                if isinstance(r.event, PolicyUpdated)]
    assert [e.metrics["version_gap_max"] for e in recorded] == [0.0, 1.0]
    assert all("correction_ratio_mean" in e.metrics and "skipped_stale" in e.metrics
               for e in recorded)

    # The SQL view answers the same, newest first.
    rows = training_steps(trainer_store.db, run_id)
    assert [(r.policy_version, r.version_gap_min, r.version_gap_max, r.samples)
            for r in rows] == [(2, 1.0, 1.0, 8), (1, 0.0, 0.0, 8)]
    assert rows[0].correction_kl == stale.metrics["correction_kl"]
    assert rows[0].skipped_stale == 0 and rows[0].uncorrected_samples == 0
    assert rows[0].negatives == int(stale.metrics["negatives"])
    assert rows[0].egpo_bonus_frac == stale.metrics.get("egpo_bonus_frac")
    assert training_steps(trainer_store.db, "no-such-run") == []

    # The run dashboard shows it.
    settings = trainer_settings.model_copy(update={"api_key_scrypt_n": 1024})
    keys = KeyStore(trainer_store.db, settings)
    token = keys.create(project="default", role="read").token
    with TestClient(create_app(settings, store=trainer_store)) as client:
        page = client.get(f"/ui/runs/{run_id}", headers={"Authorization": f"Bearer {token}"})
    assert page.status_code == 200, page.text
    body = re.search(r'id="training-steps">.*?<tbody>(.*?)</tbody>', page.text, re.S)
    assert body
    first = [html.unescape(re.sub(r"<[^>]+>", "", c)).strip()
             for c in re.findall(r"<td[^>]*>(.*?)</td>", body.group(1), re.S)]
    assert first[:4] == ["2", "2", "8", "1 / 1 / 1"]
    header = re.search(r'id="training-steps">\s*<thead>(.*?)</thead>', page.text, re.S)
    assert header and "negatives" in header.group(1) and "EGPO bonus" in header.group(1)
    assert first[10] == str(int(stale.metrics["negatives"]))


def test_staleness_metrics() -> None:
    assert staleness_metrics((3, 1, None, 2), 3) == {
        "version_unknown": 1.0, "version_gap_min": 0.0, "version_gap_mean": 1.0,
        "version_gap_max": 2.0}
    assert staleness_metrics((None,), 5) == {"version_unknown": 1.0}
