"""Lineage on the real store after a real training step of the tiny model: the step's
``policy_updated`` carries the samples it trained, the database copies them into
``step_samples`` in the same transaction, and "what fed step k" / "which steps trained
episode e" answer from there (Python API, command line, REST); unknown runs, steps and
episodes are errors naming them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trainer_episodes
from fastapi.testclient import TestClient
from trainer_episodes import new_run, record_group
from typer.testing import CliRunner

from api.app import create_app
from api.keys import KeyStore
from store import errors
from store.eventlog import run_stream_id
from store.events import PolicyUpdated, TrainedSamples
from store.lineage import episode_lineage, step_lineage
from store.settings import Settings, get_settings
from workers.engines.backend_transformers import TransformersBackend
from workers.trainer.config import TrainerConfig
from workers.trainer.loop import StepHooks, Trainer

tiny_model = trainer_episodes.tiny_model
trainer_settings = trainer_episodes.trainer_settings
trainer_store = trainer_episodes.trainer_store


def test_a_step_records_what_it_trained(trainer_store, trainer_settings: Settings,
                                        tiny_model: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    run_id = new_run(trainer_store, tiny_model, group_size=2)
    engine = TransformersBackend(tiny_model)
    for seed in (1, 2, 3):
        record_group(trainer_store, engine, run_id, size=2, seed=seed)
    config = TrainerConfig(lr=1e-2, groups_per_step=2, micro_batch_size=4)
    trainer = Trainer.open(trainer_store, run_id, config=config)
    first = trainer.step()
    assert first.trained and first.step == 1 and first.samples == 4

    # The event carries the samples, and step_samples holds them, in batch order.
    updated = [r.event for r in trainer_store.read_stream(run_stream_id(run_id))
               if isinstance(r.event, PolicyUpdated)]
    assert updated[0].trained is not None
    assert list(updated[0].trained.sample_ids) == list(first.sample_ids)
    (fed,) = step_lineage(trainer_store.db, run_id, 1)
    assert fed.policy_version == 1 and fed.dataset_id is None
    assert tuple(s.sample_id for s in fed.samples) == first.sample_ids
    with trainer_store.db.connection() as conn:
        stored = dict(conn.execute(
            "SELECT sample_id, episode_id FROM samples WHERE sample_id = ANY(%s)",
            (list(first.sample_ids),)).fetchall())
        rewards = dict(conn.execute(
            "SELECT episode_id, reward FROM episodes WHERE run_id = %s", (run_id,)).fetchall())
    assert {s.sample_id: s.episode_id for s in fed.samples} == stored
    assert [s.reward for s in fed.samples] == [rewards[s.episode_id] for s in fed.samples]
    assert len(fed.episode_ids) == 4

    # Which steps trained an episode: the first step's episodes name step 1, and one
    # trained by nothing yet gives an empty list (it exists).
    episode = fed.samples[0].episode_id
    (trained_by,) = episode_lineage(trainer_store.db, episode)
    assert (trained_by.run_id, trained_by.step, trained_by.policy_version) == (run_id, 1, 1)
    assert trained_by.sample_ids == (fed.samples[0].sample_id,)
    waiting = set(rewards) - set(fed.episode_ids)
    assert len(waiting) == 2
    assert all(episode_lineage(trainer_store.db, e) == [] for e in waiting)

    # The second step trains the remaining group; each episode is trained once.
    second = trainer.step()
    assert second.trained and second.step == 2
    (fed2,) = step_lineage(trainer_store.db, run_id, 2)
    assert set(fed2.episode_ids) == waiting
    assert all(episode_lineage(trainer_store.db, e)[0].step == 2 for e in waiting)

    # Bad input names what is wrong.
    with pytest.raises(errors.NotFoundError, match="no run 'run-missing'"):
        step_lineage(trainer_store.db, "run-missing", 1)
    with pytest.raises(errors.NotFoundError, match=f"run '{run_id}' recorded no step 7; "
                       "the steps it recorded: 1, 2$"):
        step_lineage(trainer_store.db, run_id, 7)
    with pytest.raises(errors.NotFoundError, match="no episode 'ep-missing'"):
        episode_lineage(trainer_store.db, "ep-missing")
    with pytest.raises(ValueError, match="step must be a non-negative integer"):
        step_lineage(trainer_store.db, run_id, -1)

    _rest(trainer_store, trainer_settings, run_id, fed, episode, sorted(waiting)[0])
    _cli(trainer_settings, monkeypatch, run_id, fed, episode)


def _rest(store, settings: Settings, run_id: str, fed, episode: str, waiting: str) -> None:
    settings = settings.model_copy(update={"api_key_scrypt_n": 1024})
    keys = KeyStore(store.db, settings)
    try:
        read = {"Authorization": f"Bearer {keys.create(project='default', role='read').token}"}
        other = {"Authorization": f"Bearer {keys.create(project='elsewhere', role='read').token}"}
        train = {"Authorization": f"Bearer {keys.create(project='default', role='train').token}"}
    finally:
        keys.close()
    with TestClient(create_app(settings, store=store)) as client:
        r = client.get(f"/v1/runs/{run_id}/steps/1/lineage", headers=read)
        assert r.status_code == 200, r.text
        body = r.json()
        (version,) = body["versions"]
        assert version["policy_version"] == 1 and version["dataset_id"] is None
        assert [s["sample_id"] for s in version["samples"]] == [s.sample_id for s in fed.samples]
        assert [s["reward"] for s in version["samples"]] == [s.reward for s in fed.samples]
        assert body["episode_ids"] == list(fed.episode_ids)
        r = client.get(f"/v1/episodes/{episode}/lineage", headers=read)
        assert r.status_code == 200, r.text
        assert [(s["run_id"], s["step"], s["sample_ids"]) for s in r.json()["steps"]] == [
            (run_id, 1, [fed.samples[0].sample_id])]
        assert [s["step"] for s in client.get(f"/v1/episodes/{waiting}/lineage",
                                              headers=read).json()["steps"]] == [2]
        # Bad input: 404 naming what is unknown, 422 naming the field, 403 for another
        # project's run.
        for path, named in ((f"/v1/runs/{run_id}/steps/9/lineage", "no step 9"),
                            ("/v1/runs/run-missing/steps/1/lineage", "run-missing"),
                            ("/v1/episodes/ep-missing/lineage", "ep-missing")):
            r = client.get(path, headers=read)
            assert r.status_code == 404, (path, r.text)
            assert named in r.json()["error"]["message"], (path, r.text)
        r = client.get(f"/v1/runs/{run_id}/steps/-1/lineage", headers=read)
        assert r.status_code == 422 and "step" in r.text, r.text
        r = client.get(f"/v1/runs/{run_id}/steps/1/lineage", headers=other)
        assert r.status_code == 403, r.text
        assert client.get(f"/v1/episodes/{episode}/lineage", headers=other).status_code == 403
        # A policy_updated naming a dataset version that does not exist: 422 naming the field.
        r = client.post(f"/v1/runs/{run_id}/events", headers=train, json={
            "expected_version": "any", "events": [{
                "type": "policy_updated", "version": 3, "step": 3, "trained": {
                    "sample_ids": [1], "episode_ids": [episode], "rewards": [0.5],
                    "dataset_id": 987654}}]})
        assert r.status_code == 422, r.text
        assert r.json()["error"]["field"] == "trained.dataset_id", r.text
        assert "no dataset version 987654" in r.json()["error"]["message"]
        # The same without a dataset (the run's own projection) is recorded with its lineage.
        r = client.post(f"/v1/runs/{run_id}/events", headers=train, json={
            "expected_version": "any", "events": [{
                "type": "policy_updated", "version": 3, "step": 3, "trained": {
                    "sample_ids": [1], "episode_ids": [episode], "rewards": [0.5]}}]})
        assert r.status_code == 200, r.text
        r = client.get(f"/v1/runs/{run_id}/steps/3/lineage", headers=read)
        assert r.json()["episode_ids"] == [episode], r.text


def _cli(settings: Settings, monkeypatch: pytest.MonkeyPatch, run_id: str, fed,
         episode: str) -> None:
    from trajstore.cli import app

    monkeypatch.setenv("TRAJSTORE_DATABASE_URL", settings.database_url or "")
    monkeypatch.setenv("TRAJSTORE_DATA_DIR", str(settings.data_dir))
    get_settings.cache_clear()
    runner = CliRunner()
    try:
        r = runner.invoke(app, ["lineage", "step", run_id, "--step", "1", "--json"])
        assert r.exit_code == 0, r.output
        (version,) = json.loads(r.stdout)["versions"]
        assert [s["episode_id"] for s in version["samples"]] == [
            s.episode_id for s in fed.samples]
        r = runner.invoke(app, ["lineage", "step", run_id, "--step", "1"])
        assert r.exit_code == 0 and "policy version 1, 4 samples" in r.stdout, r.output
        assert f"episode {episode}" in r.stdout
        r = runner.invoke(app, ["lineage", "episode", episode])
        assert r.exit_code == 0 and f"run {run_id} step 1" in r.stdout, r.output
        r = runner.invoke(app, ["lineage", "episode", episode, "--json"])
        assert json.loads(r.stdout)["steps"][0]["sample_ids"] == [fed.samples[0].sample_id]
        r = runner.invoke(app, ["lineage", "step", run_id, "--step", "9"])
        assert r.exit_code == 1 and "recorded no step 9" in r.stderr, r.output
        r = runner.invoke(app, ["lineage", "episode", "ep-missing"])
        assert r.exit_code == 1 and "no episode 'ep-missing'" in r.stderr, r.output
    finally:
        get_settings.cache_clear()


def test_lineage_is_written_with_the_step(trainer_store, tiny_model: Path) -> None:
    """The lineage is written by the insert of ``policy_updated``: a step that recorded and
    then failed before its acknowledgement keeps it; a ``trained`` that does not describe
    one entry per sample is refused before it reaches the database (the refused-event case
    is in the dataset test below)."""
    run_id = new_run(trainer_store, tiny_model, group_size=2)
    engine = TransformersBackend(tiny_model)
    record_group(trainer_store, engine, run_id, size=2, seed=1)
    # A policy_updated naming a sample twice is refused before it reaches the database.
    with pytest.raises(ValueError, match="names a sample twice"):
        TrainedSamples(sample_ids=[1, 1], episode_ids=["a", "b"], rewards=[0.0, 1.0])
    with pytest.raises(ValueError, match="rewards has 1 entries for 2 sample ids"):
        TrainedSamples(sample_ids=[1, 2], episode_ids=["a", "b"], rewards=[0.0])

    def fail(_lease: object) -> None:
        raise RuntimeError("acknowledgement refused")

    trainer = Trainer.open(trainer_store, run_id, config=TrainerConfig(groups_per_step=1))
    # The step records, then fails before its acknowledgement: the lineage stays with the
    # recorded step (the event is in the log).
    with pytest.raises(RuntimeError, match="acknowledgement refused"):
        trainer.step(hooks=StepHooks(before_ack=fail))
    (fed,) = step_lineage(trainer_store.db, run_id, 1)
    assert len(fed.samples) == 2


def test_a_step_that_names_a_dataset_version_records_it(trainer_store, tiny_model: Path
                                                         ) -> None:
    """A ``policy_updated`` whose ``trained`` names a dataset version (rows of it by index)
    records the version with its lineage and in ``dataset_trained_by``: the version can no
    longer be deleted. A version that does not exist refuses the event: nothing is stored."""
    from store.datasets import delete_version, get_version, read_rows
    from store.serving import append_policy_updated
    from workers.datasets import derive_dataset

    run_id = new_run(trainer_store, tiny_model, group_size=2)
    record_group(trainer_store, TransformersBackend(tiny_model), run_id, size=2, seed=1)
    made = derive_dataset(trainer_store, "lineage-ds", [run_id])
    version = made.version
    rows = read_rows(trainer_store.db, version.dataset_id)
    trained = TrainedSamples(sample_ids=list(range(len(rows))),
                             episode_ids=[r.episode_id for r in rows],
                             rewards=[r.reward for r in rows], dataset_id=version.dataset_id)

    missing = trained.model_copy(update={"dataset_id": version.dataset_id + 1000})
    with pytest.raises(errors.RefusedError,
                       match=f"dataset_id {version.dataset_id + 1000} names no dataset"):
        append_policy_updated(trainer_store, run_id, PolicyUpdated(
            version=1, step=1, trained=missing))
    assert not [r for r in trainer_store.read_stream(run_stream_id(run_id))
                if isinstance(r.event, PolicyUpdated)]

    assert append_policy_updated(trainer_store, run_id, PolicyUpdated(
        version=1, step=1, trained=trained)) is not None
    (fed,) = step_lineage(trainer_store.db, run_id, 1)
    assert fed.dataset_id == version.dataset_id
    assert [s.episode_id for s in fed.samples] == [r.episode_id for r in rows]
    (by,) = episode_lineage(trainer_store.db, rows[0].episode_id)
    assert by.dataset_id == version.dataset_id and by.sample_ids[0] == 0
    after = get_version(trainer_store.db, version.project, "lineage-ds", version.version)
    assert after is not None
    assert [(t["run_id"], t["step"]) for t in after.trained_by] == [(run_id, 1)]
    with pytest.raises(errors.StoreError, match="trained"):
        delete_version(trainer_store.db, version.project, "lineage-ds", version.version)
