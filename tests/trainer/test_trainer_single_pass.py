"""The step without its scoring forward (old log-probs from the update's own forward) trains
exactly as the step with it, on the tiny model: same loss, same updated weights, same old
log-probs, advantages and correction; and it is used only where that holds."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from store.events import CorrectionConfig
from store.stored_sample import StoredSample
from workers.engines.tinymodel import tiny_model_path
from workers.trainer.advantages import AdvantageSettings
from workers.trainer.batch import TrainingBatch, pad_samples
from workers.trainer.checkpoint import load_model
from workers.trainer.config import TrainerConfig
from workers.trainer.loop import unit_loss_weights
from workers.trainer.ppo import ppo_update, score_batch
from workers.trainer.update import single_pass, update_batch

THINK, UNTHINK = 5, 6


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_path(tmp_path_factory.mktemp("tiny"))


def batch_of(model_path: Path, lengths: list[int], seed: int = 0) -> TrainingBatch:
    """Variable-length samples with a <think> block in each response, and rollout log-probs
    near the model's own (one row without any: left uncorrected)."""
    rng = np.random.default_rng(seed)
    samples = []
    for index, length in enumerate(lengths):
        prompt = max(1, length // 3)
        ids = rng.integers(10, 768, length)
        ids[prompt] = THINK
        ids[prompt + (length - prompt) // 2] = UNTHINK
        mask = np.zeros(length, dtype=np.int64)
        mask[prompt:] = 1
        samples.append(StoredSample(
            sample_id=index, run_id="run", group_id=f"g{index // 3}", episode_id=f"e{index}",
            agent="main", kind="positive", reward=float(rng.random()), policy_version=0,
            prompt_length=prompt, token_ids=ids, loss_mask=mask,
            logprobs=np.zeros(length, dtype=np.float32)))
    batch = pad_samples(samples, pad_token_id=0, vocab_size=768)
    old, _ = score_batch(load_model(model_path), batch, config=TrainerConfig())
    noise = torch.from_numpy(rng.normal(0.0, 0.3, tuple(old.shape)).astype(np.float32))
    rollout = (old + noise) * batch.response_mask
    rollout[1] = 0.0
    return dataclasses.replace(batch, rollout_log_probs=rollout)


def run(model_path: Path, batch: TrainingBatch, config: TrainerConfig, *, estimator: str,
        correction: CorrectionConfig, units: list[str] | None = None):
    torch.manual_seed(0)
    model = load_model(model_path)
    reference = load_model(model_path).requires_grad_(False) if config.kl_coef > 0 else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    update = update_batch(
        model, batch, optimizer=optimizer, config=config, estimator=estimator,
        advantage_settings=AdvantageSettings(cot_start_id=THINK, cot_end_id=UNTHINK),
        correction=correction, reference=reference, units=units,
        unit_weights=unit_loss_weights(units) if units is not None else None)
    return update, model.state_dict()


BYPASS = {"mode": "bypass", "loss_type": "reinforce", "is_threshold": 1.2,
          "rejection": [{"mode": "seq_mean_k1", "upper": 1.3}, {"mode": "token_k3", "upper": 0.5}]}


@pytest.mark.parametrize("estimator,kl_coef,correction,units", [
    ("grpo", 0.0, {"is_level": "token", "is_threshold": 1.2}, None),
    ("egpo", 0.1, {"is_level": "sequence", "is_threshold": 1.2},
     ["e0", "e0", "e1", "e2", "e2", "e3", "e4"]),
    ("grpo", 0.0, {"is_level": "token", "is_threshold": 1.2, "is_threshold_lower": 0.8}, None),
    ("egpo", 0.0, {**BYPASS, "is_level": "token"}, ["e0", "e0", "e1", "e2", "e2", "e3", "e4"]),
    ("grpo", 0.0, {**BYPASS, "is_level": "sequence", "is_batch_normalize": True}, None),
])
def test_skipped_scoring_trains_as_the_scoring_step(model_path: Path, estimator: str,
                                                    kl_coef: float, correction: dict,
                                                    units: list[str] | None) -> None:
    """Also in bypass mode (its weights and rejection are computed in each micro-batch's
    loss) and with IcePop (row-local weights)."""
    batch = batch_of(model_path, [30, 12, 41, 9, 26, 18, 33], seed=1)
    settings = CorrectionConfig.model_validate(correction)
    config = TrainerConfig(micro_batch_size=3, kl_coef=kl_coef, entropy_coeff=0.01)
    one, one_weights = run(model_path, batch, config, estimator=estimator,
                           correction=settings, units=units)
    two, two_weights = run(model_path, batch, config.replace(separate_scoring=True),
                           estimator=estimator, correction=settings, units=units)
    assert one.single_pass and not two.single_pass
    mask = batch.response_mask
    assert float(((one.old_log_probs - two.old_log_probs).abs() * mask).max()) < 1e-6
    assert float(((one.entropies - two.entropies).abs() * mask).max()) < 1e-6
    assert torch.allclose(one.advantages, two.advantages, atol=1e-6)
    assert torch.allclose(one.correction.weights, two.correction.weights, atol=1e-6)
    for name, value in two.correction.metrics.items():
        assert one.correction.metrics[name] == pytest.approx(value, abs=1e-6), name
    # The correction did something: weights off 1, capped ones, one row uncorrected.
    assert two.correction.metrics["correction_clipped_frac"] > 0
    assert two.correction.metrics["correction_uncorrected_samples"] == 1
    first, second = one.stats.metrics(), two.stats.metrics()
    for name in ("pg_loss", "grad_norm", "entropy", "pg_clipfrac", "ppo_kl"):
        if name in second:
            assert first[name] == pytest.approx(second[name], abs=1e-6), name
    if kl_coef:
        assert first["kl_loss"] == pytest.approx(second["kl_loss"], abs=1e-6)
    if estimator == "egpo":  # the bonus moved the advantages off GRPO's
        assert float((two.advantages.abs() * mask).sum()) > 0
    assert max(float((one_weights[k] - v).abs().max()) for k, v in two_weights.items()) < 1e-6
    initial = load_model(model_path).state_dict()
    assert max(float((two_weights[k] - v).abs().max()) for k, v in initial.items()) > 1e-4


def test_scoring_kept_where_the_forward_is_not_the_old_policy(model_path: Path) -> None:
    plain = CorrectionConfig()
    config = TrainerConfig()
    assert single_pass(config, samples=8, estimator="grpo", correction=plain)
    assert single_pass(config.replace(mini_batch_size=8), samples=8, estimator="egpo",
                       correction=plain)
    # Several epochs or mini-batches: later forwards see updated weights.
    assert not single_pass(config.replace(ppo_epochs=2), samples=8, estimator="grpo",
                           correction=plain)
    assert not single_pass(config.replace(mini_batch_size=4), samples=8, estimator="grpo",
                           correction=plain)
    # Decoupled rejection changes the counts every micro-batch's loss is divided by, and
    # batch normalisation needs the whole batch's mean; bypass mode does both in the loss.
    assert not single_pass(config, samples=8, estimator="grpo",
                           correction=CorrectionConfig(rejection="token"))
    assert not single_pass(config, samples=8, estimator="grpo",
                           correction=CorrectionConfig(is_batch_normalize=True))
    assert single_pass(config, samples=8, estimator="grpo",
                       correction=CorrectionConfig.model_validate(BYPASS))
    assert not single_pass(config.replace(separate_scoring=True), samples=8, estimator="grpo",
                           correction=plain)
    assert not single_pass(config, samples=8, estimator="other", correction=plain)

    batch = batch_of(model_path, [20, 14, 9, 17], seed=2)
    update, _ = run(model_path, batch, TrainerConfig(micro_batch_size=2, mini_batch_size=2),
                    estimator="grpo", correction=plain)
    assert not update.single_pass and update.stats.optimizer_steps == 2


def test_ppo_update_refuses_a_first_pass_it_cannot_honour(model_path: Path) -> None:
    batch = batch_of(model_path, [12, 9, 15, 7], seed=3)
    model = load_model(model_path)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def first_pass(rows, old, entropies):
        return torch.ones_like(old), None

    with pytest.raises(ValueError, match="one epoch over one mini-batch"):
        ppo_update(model, batch, optimizer=optimizer, old_log_probs=None, advantages=None,
                   config=TrainerConfig(ppo_epochs=2), first_pass=first_pass)
    with pytest.raises(ValueError, match="one epoch over one mini-batch"):
        ppo_update(model, batch, optimizer=optimizer, old_log_probs=None, advantages=None,
                   config=TrainerConfig(mini_batch_size=2), first_pass=first_pass)
    with pytest.raises(ValueError, match="first_pass and neither"):
        ppo_update(model, batch, optimizer=optimizer, old_log_probs=None, advantages=None,
                   config=TrainerConfig())
    old = torch.zeros_like(batch.rollout_log_probs)
    with pytest.raises(ValueError, match="first_pass and neither"):
        ppo_update(model, batch, optimizer=optimizer, old_log_probs=old, advantages=old,
                   config=TrainerConfig(), first_pass=first_pass)
    with pytest.raises(TypeError, match="separate_scoring must be a bool"):
        TrainerConfig(separate_scoring="yes")  # type: ignore[arg-type]
