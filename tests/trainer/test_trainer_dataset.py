"""Training from a dataset version, and replaying a recorded step, on the real store with the
tiny model on the CPU: a trainer given ``dataset=`` trains that version's rows group by
group (every group once before any twice), each ``policy_updated`` names the version and
the row indexes it trained, and the version can then be neither changed nor deleted;
``replay-step`` recomputes a step from the log and the checkpoint before it and gets the
stored weights exactly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import psycopg
import pytest
import trainer_episodes
from trainer_episodes import new_run, record_group
from typer.testing import CliRunner

from store import errors
from store.eventlog import run_stream_id
from store.events import PolicyUpdated
from store.lineage import step_lineage
from store.settings import Settings, get_settings
from workers.engines.backend_transformers import TransformersBackend
from workers.trainer.config import TrainerConfig
from workers.trainer.loop import Trainer
from workers.trainer.replay import replay_step

tiny_model = trainer_episodes.tiny_model
trainer_settings = trainer_episodes.trainer_settings
trainer_store = trainer_episodes.trainer_store

CONFIG = TrainerConfig(lr=1e-2, groups_per_step=1, micro_batch_size=4, device="cpu")


@pytest.fixture
def cli(trainer_settings: Settings, monkeypatch: pytest.MonkeyPatch):
    from trajstore.cli import app

    monkeypatch.setenv("TRAJSTORE_DATABASE_URL", trainer_settings.database_url or "")
    monkeypatch.setenv("TRAJSTORE_DATA_DIR", str(trainer_settings.data_dir))
    get_settings.cache_clear()
    runner = CliRunner()
    yield lambda *args: runner.invoke(app, list(args))
    get_settings.cache_clear()


def _updates(store, run_id: str) -> list[PolicyUpdated]:
    return [r.event for r in store.read_stream(run_stream_id(run_id))
            if isinstance(r.event, PolicyUpdated)]


def test_train_from_a_dataset_version(trainer_store, tiny_model: Path, cli) -> None:
    from store.datasets import delete_version, read_rows
    from workers.datasets import derive_dataset

    source = new_run(trainer_store, tiny_model, group_size=2)
    engine = TransformersBackend(tiny_model)
    for seed in (1, 2):
        record_group(trainer_store, engine, source, size=2, seed=seed)
    version = derive_dataset(trainer_store, "train-ds", [source]).version
    rows = read_rows(trainer_store.db, version.dataset_id)
    groups = list(dict.fromkeys(r.group_id for r in rows))
    assert len(groups) == 2

    # A run of its own trains the dataset: nothing of the source run's projection is leased.
    run_id = new_run(trainer_store, tiny_model, group_size=2)
    trainer = Trainer.open(trainer_store, run_id, config=CONFIG, dataset="train-ds@1")
    done = trainer.train(3)
    assert [r.version for r in done] == [1, 2, 3]
    updates = _updates(trainer_store, run_id)
    trained_groups = []
    for update in updates:
        assert update.trained is not None and update.trained.dataset_id == version.dataset_id
        ids = list(update.trained.sample_ids)
        assert [rows[i].episode_id for i in ids] == list(update.trained.episode_ids)
        assert [rows[i].reward for i in ids] == list(update.trained.rewards)
        assert len({rows[i].group_id for i in ids}) == 1
        # Every row of the group, in row order.
        group = rows[ids[0]].group_id
        assert ids == [i for i, r in enumerate(rows) if r.group_id == group]
        trained_groups.append(group)
    # Every group once before any twice.
    assert trained_groups == [groups[0], groups[1], groups[0]]
    (fed,) = step_lineage(trainer_store.db, run_id, 2)
    assert fed.dataset_id == version.dataset_id
    with trainer_store.db.connection() as conn:
        statuses = {s for (s,) in conn.execute(
            "SELECT DISTINCT status FROM samples WHERE run_id = %s", (source,)).fetchall()}
    assert statuses == {"ready"}

    # A reopened trainer continues from the lineage: the next group is the second one.
    again = Trainer.open(trainer_store, run_id, config=CONFIG, dataset=version.dataset_id)
    assert again.step().trained
    assert {rows[i].group_id for i in _updates(trainer_store, run_id)[-1].trained.sample_ids
            } == {groups[1]}

    # The version trained by recorded steps cannot be deleted nor changed.
    with pytest.raises(errors.RefusedError, match="cannot be deleted: 4 training step"):
        delete_version(trainer_store.db, version.project, "train-ds", 1)
    r = cli("dataset", "delete", "train-ds@1")
    assert r.exit_code == 1 and "cannot be deleted" in r.stderr, r.output
    with trainer_store.db.connection() as conn, pytest.raises(
            psycopg.errors.InsufficientPrivilege, match="immutable"):
        conn.execute("UPDATE dataset_rows SET reward = 5 WHERE dataset_id = %s",
                     (version.dataset_id,))
    with trainer_store.db.connection() as conn, pytest.raises(
            psycopg.errors.InsufficientPrivilege, match="immutable"):
        conn.execute("UPDATE datasets SET name = 'x' WHERE dataset_id = %s",
                     (version.dataset_id,))
    assert len(read_rows(trainer_store.db, version.dataset_id)) == len(rows)

    # A step trained from a dataset replays exactly (the newest: two checkpoints are kept).
    replayed = replay_step(trainer_store, run_id, 4)
    assert replayed.dataset_id == version.dataset_id and replayed.max_abs_diff == 0.0

    # Bad input names what is wrong, and trains nothing.
    with pytest.raises(errors.NotFoundError, match="no dataset 'train-ds@7'"):
        Trainer.open(trainer_store, run_id, config=CONFIG, dataset="train-ds@7")
    with pytest.raises(errors.NotFoundError, match="no dataset version with id 987654"):
        Trainer.open(trainer_store, run_id, config=CONFIG, dataset=987654)

    # The command line: --dataset trains it; an unknown version is an error naming it.
    r = cli("train", "--run", run_id, "--dataset", "train-ds@1", "--steps", "1",
            "--groups", "1", "--lr", "0.01", "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert len(_updates(trainer_store, run_id)) == 5
    r = cli("train", "--run", run_id, "--dataset", "nope@2", "--device", "cpu")
    assert r.exit_code == 1 and "no dataset 'nope@2'" in r.output, r.output
    assert len(_updates(trainer_store, run_id)) == 5


def test_replay_step_gives_the_stored_weights(trainer_store, tiny_model: Path, cli) -> None:
    run_id = new_run(trainer_store, tiny_model, group_size=2)
    engine = TransformersBackend(tiny_model)
    for seed in (1, 2):
        record_group(trainer_store, engine, run_id, size=2, seed=seed)
    trainer = Trainer.open(trainer_store, run_id, config=CONFIG)
    assert [r.step for r in trainer.train(2)] == [1, 2]
    first, second = _updates(trainer_store, run_id)

    result = replay_step(trainer_store, run_id, 2)
    assert result.max_abs_diff == 0.0 and result.within(0.0)
    assert result.samples == 2 and result.started_from == first.checkpoint
    assert result.tensors > 0 and not result.missing
    assert replay_step(trainer_store, run_id, 1).max_abs_diff == 0.0  # from the initial model

    r = cli("replay-step", run_id, "--step", "2", "--json")
    assert r.exit_code == 0, r.output
    body = json.loads(r.stdout)
    assert body["max_abs_diff"] == 0.0 and body["identical"] is True
    r = cli("replay-step", run_id, "--step", "2")
    assert r.exit_code == 0 and "max abs diff 0.0" in r.stdout and "identical" in r.stdout

    # Bad input: an unknown run or step is an error naming it.
    r = cli("replay-step", "run-missing", "--step", "1")
    assert r.exit_code == 1 and "run-missing" in r.stderr, r.output
    r = cli("replay-step", run_id, "--step", "9")
    assert r.exit_code == 1 and "recorded no step 9; the steps it recorded: 1, 2" in r.stderr, \
        r.output

    # Weights that differ from the replay: exit 1 with the largest difference.
    assert first.checkpoint and second.checkpoint
    stored = Path(second.checkpoint) / "model.safetensors"
    shutil.copyfile(Path(first.checkpoint) / "model.safetensors", stored)
    r = cli("replay-step", run_id, "--step", "2", "--json")
    assert r.exit_code == 1, r.output
    body = json.loads(r.stdout)
    assert body["max_abs_diff"] > 0.0 and body["identical"] is False
    r = cli("replay-step", run_id, "--step", "2", "--tolerance", "1000")
    assert r.exit_code == 0 and "within tolerance" in r.stdout, r.output

    # A missing checkpoint is named: the one the step started from, then its own.
    shutil.rmtree(first.checkpoint)
    r = cli("replay-step", run_id, "--step", "2")
    assert r.exit_code == 1 and "checkpoint of step 1" in r.stderr, r.output
    assert first.checkpoint in r.stderr
    shutil.rmtree(second.checkpoint)
    with pytest.raises(errors.NotFoundError, match="checkpoint of step 2 .* is missing"):
        replay_step(trainer_store, run_id, 2)


def _shifted_copy(model: Path, target: Path) -> Path:
    """A copy of the model folder with every weight moved by 0.01: another initial model."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, target)
    weights = target / "model.safetensors"
    save_file({k: v + 0.01 for k, v in load_file(str(weights)).items()}, str(weights),
              metadata={"format": "pt"})
    return target


def test_replay_step_starts_from_the_model_the_trainer_started_from(
        trainer_store, tiny_model: Path, cli, tmp_path: Path) -> None:
    run_id = new_run(trainer_store, tiny_model, group_size=2)
    engine = TransformersBackend(tiny_model)
    for seed in (1, 2):
        record_group(trainer_store, engine, run_id, size=2, seed=seed)
    other = _shifted_copy(tiny_model, tmp_path / "other-model")
    # Another initial model than the run's, with a KL term: the first step starts from it and
    # every step's reference is it.
    trainer = Trainer.open(trainer_store, run_id, config=CONFIG.replace(kl_coef=0.1),
                           model=str(other))
    assert [r.step for r in trainer.train(2)] == [1, 2]
    first, second = _updates(trainer_store, run_id)
    assert first.checkpoint and second.checkpoint
    state = json.loads((Path(first.checkpoint) / "trainer_state.json").read_text())
    assert state["trainer"]["initial_model"] == str(other)

    for step in (1, 2):
        result = replay_step(trainer_store, run_id, step)
        assert result.max_abs_diff == 0.0, (step, result)
        assert result.initial_model == str(other) and result.initial_from == "recorded"
    assert replay_step(trainer_store, run_id, 1).started_from == str(other)

    r = cli("replay-step", run_id, "--step", "1")
    assert r.exit_code == 0, r.output
    assert f"initial model {other} (recorded by the trainer)" in r.stdout
    assert "max abs diff 0.0" in r.stdout and "identical" in r.stdout

    # --model overrides what was recorded, and says so: the run's model is not the one the
    # step started from, so the weights differ.
    r = cli("replay-step", run_id, "--step", "1", "--model", str(tiny_model), "--json")
    assert r.exit_code == 1, r.output
    body = json.loads(r.stdout)
    assert body["initial_model"] == str(tiny_model) and body["initial_from"] == "override"
    assert body["max_abs_diff"] > 0.0 and body["started_from"] == str(tiny_model)
    r = cli("replay-step", run_id, "--step", "2", "--model", str(other))
    assert r.exit_code == 0 and "(given with --model)" in r.stdout, r.output

    # Bad input: an override pointing to a missing folder is an error naming it.
    missing = tmp_path / "no-such-model"
    r = cli("replay-step", run_id, "--step", "1", "--model", str(missing))
    assert r.exit_code == 1 and str(missing) in r.stderr and "--model" in r.stderr, r.output
    with pytest.raises(errors.NotFoundError, match="no-such-model"):
        replay_step(trainer_store, run_id, 2, model=missing)

    # A checkpoint written before the initial model was recorded: the run's model is used
    # (and named); here it is not the one the step started from.
    path = Path(first.checkpoint) / "trainer_state.json"
    record = json.loads(path.read_text())
    del record["trainer"]["initial_model"]
    path.write_text(json.dumps(record))
    old = replay_step(trainer_store, run_id, 1)
    assert old.initial_from == "run" and old.initial_model == str(tiny_model)
    assert old.max_abs_diff > 0.0
    # A recorded initial model that is gone is named as well.
    shutil.rmtree(other)
    with pytest.raises(errors.NotFoundError, match="initial model .* recorded is missing"):
        replay_step(trainer_store, run_id, 2)
