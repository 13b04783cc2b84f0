"""The trainer worker's parts on their own: hyperparameters, advantage estimator choice,
checkpoints, weight pushing and the per-process trainer cache."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import trainer_episodes
from trainer_episodes import new_run

from workers.engines.backend import GenerationRequest, SamplingParams
from workers.engines.backend_transformers import TransformersBackend
from workers.engines.tokenizers import load_tokenizer
from workers.trainer import worker as trainer_worker
from workers.trainer.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageSettings,
    choose_estimator,
    think_token_ids,
)
from workers.trainer.checkpoint import (
    OPTIMIZER_FILE,
    checkpoint_dir,
    load_model,
    load_optimizer_state,
    prune_checkpoints,
    read_state,
    save_checkpoint,
)
from workers.trainer.config import TrainerConfig
from workers.trainer.egpo import egpo_advantages, grpo_advantages
from workers.trainer.loop import Trainer
from workers.trainer.weights import push_weights

tiny_model = trainer_episodes.tiny_model
trainer_settings = trainer_episodes.trainer_settings
trainer_store = trainer_episodes.trainer_store


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Any:
    return load_model(tiny_model)


# --- configuration --------------------------------------------------------------------------

@pytest.mark.parametrize(("changes", "error", "message"), [
    ({"groups_per_step": 0}, ValueError, "groups_per_step must be >= 1"),
    ({"micro_batch_size": 2.5}, TypeError, "micro_batch_size must be an integer"),
    ({"mini_batch_size": 0}, ValueError, "mini_batch_size"),
    ({"lr": 0.0}, ValueError, "lr must be > 0"),
    ({"lr": float("nan")}, ValueError, "lr must be finite"),
    ({"clip_ratio_low": 1.0}, ValueError, "clip_ratio_low must be < 1"),
    ({"clip_ratio_c": 1.0}, ValueError, "clip_ratio_c must be > 1"),
    ({"betas": (0.9, 1.0)}, ValueError, "betas"),
    ({"loss_agg_mode": "mean"}, ValueError, "unknown loss_agg_mode 'mean'"),
    ({"kl_kind": "k9"}, ValueError, "unknown KL kind 'k9'"),
    ({"advantage_estimator": "ppo"}, ValueError, "advantage_estimator"),
    ({"dtype": "int8"}, ValueError, "dtype"),
    ({"max_staleness": -1}, ValueError, "max_staleness"),
    ({"entropy_coeff": -0.1}, ValueError, "entropy_coeff must be >= 0"),
    ({"norm_adv_by_std": 1}, TypeError, "norm_adv_by_std"),
    ({"no_such_field": 1}, TypeError, "no_such_field"),
])
def test_bad_config_values_are_named(changes: dict[str, Any], error: type[Exception],
                                     message: str) -> None:
    with pytest.raises(error, match=message):
        TrainerConfig(**changes)


def test_config_round_trips_through_json() -> None:
    config = TrainerConfig(lr=3e-4, betas=(0.8, 0.95), kl_kind="k3+", max_staleness=2)
    again = TrainerConfig(**json.loads(json.dumps(config.to_dict())))
    assert again == config and again.betas == (0.8, 0.95)
    assert config.replace(lr=1.0).lr == 1.0
    with pytest.raises(ValueError, match="lr"):
        config.replace(lr=-1.0)


# --- advantages -----------------------------------------------------------------------------

def test_estimator_follows_the_run_unless_configured(tiny_model: Path) -> None:
    assert choose_estimator(None, egpo_lam=0.4) == "egpo"
    assert choose_estimator(None, egpo_lam=0.0) == "grpo"
    assert choose_estimator("grpo", egpo_lam=0.4) == "grpo"
    with pytest.raises(ValueError, match="unknown advantage estimator 'rloo'"):
        choose_estimator("rloo", egpo_lam=0.4)
    tokenizer = load_tokenizer(str(tiny_model))
    start, end = think_token_ids(tokenizer)
    assert tokenizer.convert_ids_to_tokens([start, end]) == ["<think>", "</think>"]
    assert think_token_ids(tokenizer, start=7, end=8) == (7, 8)


def test_registered_estimators_equal_the_math() -> None:
    gen = torch.Generator().manual_seed(3)
    responses = torch.randint(5, 50, (6, 10), generator=gen)
    responses[:, 0] = 3  # <think> opens every response
    responses[:3, 6] = 4  # ... and closes it in half of them
    mask = (torch.rand(6, 10, generator=gen) < 0.9).float()
    rewards = torch.zeros(6, 10)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.2])
    entropies = torch.rand(6, 10, generator=gen) * 3
    index = ["a", "a", "a", "b", "b", "b"]
    settings = AdvantageSettings(lam=0.4, alpha=2.0, variant="paper", cot_start_id=3,
                                 cot_end_id=4)
    egpo = ADVANTAGE_ESTIMATORS.get("egpo")(rewards, mask, index, entropies=entropies,
                                            responses=responses, settings=settings)
    expected, _ = egpo_advantages(rewards, mask, index, entropies, responses, cot_start_id=3,
                                  cot_end_id=4, lam=0.4, alpha=2.0, variant="paper")
    assert torch.equal(egpo, expected)
    grpo = ADVANTAGE_ESTIMATORS.get("grpo")(rewards, mask, index, entropies=entropies,
                                            responses=responses, settings=settings)
    assert torch.equal(grpo, grpo_advantages(rewards, mask, index)[0])
    assert not torch.equal(egpo, grpo)  # the CoT entropy bonus moved the nonzero advantages
    with pytest.raises(ValueError, match="cot_start_id and cot_end_id"):
        ADVANTAGE_ESTIMATORS.get("egpo")(rewards, mask, index, entropies=entropies,
                                         responses=responses, settings=AdvantageSettings())


def test_trainer_uses_egpo_for_an_egpo_run(trainer_store, tiny_model: Path) -> None:
    run_id = new_run(trainer_store, tiny_model, lam=0.4)
    trainer = Trainer.open(trainer_store, run_id)
    assert trainer.estimator == "egpo"
    assert (trainer.advantage_settings.cot_start_id,
            trainer.advantage_settings.cot_end_id) == (3, 4)
    grpo_run = new_run(trainer_store, tiny_model, lam=0.0)
    assert Trainer.open(trainer_store, grpo_run).estimator == "grpo"


# --- checkpoints ----------------------------------------------------------------------------

def test_checkpoint_round_trip_with_optimizer(model: Any, tiny_model: Path,
                                              tmp_path: Path) -> None:
    trained = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-2)
    ids = torch.tensor([[5, 6, 7, 8]])
    trained(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    folder = checkpoint_dir(tmp_path, "run/odd name", version=3)
    path = save_checkpoint(folder, model=trained, state={"version": 3, "step": 7},
                           tokenizer=load_tokenizer(str(tiny_model)), optimizer=optimizer)
    assert path == folder and (path / OPTIMIZER_FILE).is_file()
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no staging left
    assert read_state(path) == {"version": 3, "step": 7}
    loaded = load_model(path)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in trained.state_dict().items())
    fresh = torch.optim.AdamW(loaded.parameters(), lr=1e-2)
    assert load_optimizer_state(path, fresh)
    for old, new in zip(trained.parameters(), loaded.parameters(), strict=True):
        before, after = optimizer.state[old], fresh.state[new]
        assert torch.equal(before["exp_avg"], after["exp_avg"])
        assert torch.equal(before["exp_avg_sq"], after["exp_avg_sq"])
    # The folder is a model folder an engine loads: same greedy answer as the trained model.
    engine = TransformersBackend(path)
    request = GenerationRequest(sampling=SamplingParams(temperature=0.0, max_tokens=6),
                                messages=({"role": "user", "content": "hi"},))
    assert engine.generate(request).response_ids.tolist() == TransformersBackend(
        trained, tokenizer=engine.tokenizer).generate(request).response_ids.tolist()
    # Saving the same version again replaces the folder whole.
    save_checkpoint(folder, model=trained, state={"version": 3, "step": 8})
    assert read_state(folder)["step"] == 8 and not (folder / OPTIMIZER_FILE).exists()
    assert not load_optimizer_state(folder, fresh)


def test_checkpoint_errors_and_pruning(model: Any, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="run_id"):
        checkpoint_dir(tmp_path, "", version=1)
    with pytest.raises(ValueError, match="version"):
        checkpoint_dir(tmp_path, "r", version=-1)
    with pytest.raises(ValueError, match="tag"):
        checkpoint_dir(tmp_path, "r", version=1, tag="A/B")
    assert (checkpoint_dir(tmp_path, "a/b", version=1)
            != checkpoint_dir(tmp_path, "a_b", version=1))
    assert checkpoint_dir(tmp_path, "r", version=12, tag="ab12").name == "v000012-ab12"
    with pytest.raises(TypeError, match="transformers model"):
        save_checkpoint(tmp_path / "x", model=object(), state={})
    with pytest.raises(FileNotFoundError, match="not a trainer checkpoint"):
        read_state(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        load_model(tmp_path / "missing")
    run = tmp_path / "checkpoints" / "run"
    for version, tag in ((1, None), (2, "aa"), (10, None), (3, None)):
        (checkpoint_dir(tmp_path, "run", version=version, tag=tag)).mkdir(parents=True)
    (run / "notes.txt").write_text("kept")
    deleted = prune_checkpoints(run, keep=2)
    assert sorted(p.name for p in deleted) == ["v000001", "v000002-aa"]
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt", "v000003", "v000010"]
    with pytest.raises(ValueError, match="keep"):
        prune_checkpoints(run, keep=0)
    other = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    path = save_checkpoint(tmp_path / "ck", model=model, state={},
                           optimizer=torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match="parameter groups of sizes"):
        load_optimizer_state(path, other)


# --- weights --------------------------------------------------------------------------------

def test_push_weights_loads_the_engine(model: Any, tiny_model: Path) -> None:
    engine = TransformersBackend(tiny_model)
    moved = copy.deepcopy(model)
    with torch.no_grad():
        moved.lm_head.weight.mul_(3.0)
    sent = push_weights(moved, engine, version=5)
    assert sent == len(moved.state_dict()) and engine.policy_version == 5
    assert torch.equal(engine.model.lm_head.weight, moved.lm_head.weight)
    with pytest.raises(TypeError, match="update_weights"):
        push_weights(moved, object(), version=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="version must be >= 0"):
        push_weights(moved, engine, version=-1)
    with pytest.raises(ValueError, match="unknown weight name"):
        push_weights(torch.nn.Linear(2, 2), engine, version=6)


# --- the per-process cache ------------------------------------------------------------------

def test_worker_cache_reuses_and_drops_trainers(trainer_store, tiny_model: Path) -> None:
    trainer_worker.forget()
    run_id = new_run(trainer_store, tiny_model)
    first = trainer_worker.run_train_step(trainer_store, run_id, config={"lr": 1e-3})
    assert first["version"] is None and first["samples"] == 0  # nothing recorded yet
    assert trainer_worker.cached_runs() == [run_id]
    cached = trainer_worker._trainers[run_id][1]
    trainer_worker.run_train_step(trainer_store, run_id, config={"lr": 1e-3})
    assert trainer_worker._trainers[run_id][1] is cached  # kept in memory
    trainer_worker.run_train_step(trainer_store, run_id, config={"lr": 2e-3})
    assert trainer_worker._trainers[run_id][1] is not cached  # new settings: reopened
    engine = TransformersBackend(tiny_model)
    trainer_worker.attach_engine(run_id, engine)
    assert trainer_worker._trainers[run_id][1].engine is engine
    with pytest.raises(TypeError, match="update_weights"):
        trainer_worker.attach_engine(run_id, object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bogus"):
        trainer_worker.run_train_step(trainer_store, run_id, config={"bogus": 1})
    trainer_worker.attach_engine(run_id, None)
    trainer_worker.forget(run_id)
    assert trainer_worker.cached_runs() == []
