"""Response log-probs under the tiny model against a per-sample full-logits reference, and the
PPO update's gradient accumulation against one big micro-batch."""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import trainer_episodes

from workers.engines.backend import GenerationRequest, SamplingParams
from workers.engines.backend_transformers import TransformersBackend
from workers.trainer.batch import pad_samples
from workers.trainer.checkpoint import load_model
from workers.trainer.config import TrainerConfig
from workers.trainer.kl import kl_penalty
from workers.trainer.policy import output_head, response_log_probs
from workers.trainer.ppo import ppo_update, score_batch

tiny_model = trainer_episodes.tiny_model


@dataclass(frozen=True)
class Sample:
    sample_id: int
    group_id: str
    kind: str
    reward: float
    policy_version: int | None
    prompt_length: int
    token_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray


def random_samples(seed: int, count: int, vocab: int) -> list[Sample]:
    rng = random.Random(seed)
    samples = []
    for i in range(count):
        prompt = rng.randint(1, 12)
        response = rng.randint(1, 10)
        mask = [0] * prompt + [int(rng.random() < 0.8) for _ in range(response)]
        samples.append(Sample(
            sample_id=i, group_id=f"g{i % 2}", kind="positive", reward=rng.random(),
            policy_version=0, prompt_length=prompt,
            token_ids=np.array([rng.randrange(vocab) for _ in mask], dtype=np.int32),
            loss_mask=np.array(mask, dtype=np.uint8),
            logprobs=np.zeros(len(mask), dtype=np.float32)))
    return samples


def loop_response_log_probs(model: Any, sample: Sample, temperature: float
                            ) -> tuple[list[float], list[float]]:
    """One sample alone, unpadded: full logits, log-softmax, read token by token."""
    ids = torch.tensor([sample.token_ids.tolist()], dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double() / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    out_lp, out_h = [], []
    for t in range(sample.prompt_length, len(sample.token_ids)):
        row = log_probs[t - 1]
        out_lp.append(float(row[int(sample.token_ids[t])]))
        out_h.append(float(-(row.exp() * row).sum()))
    return out_lp, out_h


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Any:
    return load_model(tiny_model)


@pytest.mark.parametrize(("seed", "temperatures", "chunk"), [
    (0, [1.0] * 5, 1024), (1, [0.7] * 5, 5), (2, [1.3] * 5, 1),
    (3, [0.7, 1.0, 0.3, 0.7, 1.6], 4),  # each row at its own sampling temperature
])
def test_response_log_probs_match_per_sample_reference(model: Any, seed: int,
                                                       temperatures: list[float],
                                                       chunk: int) -> None:
    samples = random_samples(seed, 5, model.config.vocab_size)
    batch = pad_samples(samples, pad_token_id=0, temperatures=temperatures)
    with torch.no_grad():
        log_probs, entropies = response_log_probs(model, batch, chunk_size=chunk)
    assert log_probs.shape == batch.responses.shape == entropies.shape
    for row, sample in enumerate(samples):
        expected_lp, expected_h = loop_response_log_probs(model, sample, temperatures[row])
        n = len(expected_lp)
        assert log_probs[row, :n].tolist() == pytest.approx(expected_lp, abs=1e-5)
        assert entropies[row, :n].tolist() == pytest.approx(expected_h, abs=1e-5)


def test_recomputed_log_probs_equal_the_engines(tiny_model: Path, model: Any) -> None:
    engine = TransformersBackend(tiny_model)
    samples = []
    for seed in range(3):
        result = engine.generate(GenerationRequest(
            sampling=SamplingParams(temperature=0.8, max_tokens=5 + 3 * seed, seed=seed),
            messages=({"role": "user", "content": "Count" + "!" * seed},)))
        ids = np.concatenate([result.prompt_ids, result.response_ids])
        prompt = len(result.prompt_ids)
        samples.append(Sample(
            sample_id=seed, group_id="g", kind="positive", reward=0.0, policy_version=0,
            prompt_length=prompt, token_ids=ids,
            loss_mask=(np.arange(len(ids)) >= prompt).astype(np.uint8),
            logprobs=np.concatenate([np.zeros(prompt, np.float32), result.logprobs])))
    batch = pad_samples(samples, pad_token_id=0, temperatures=0.8)
    old, _ = score_batch(model, batch, config=TrainerConfig(micro_batch_size=2))
    diff = ((old - batch.rollout_log_probs).abs() * batch.response_mask).max()
    assert float(diff) < 1e-4


def test_gradients_reach_the_model(model: Any) -> None:
    batch = pad_samples(random_samples(3, 2, model.config.vocab_size), pad_token_id=0)
    trained = copy.deepcopy(model)
    log_probs, entropies = response_log_probs(trained, batch)
    ((log_probs + entropies) * batch.response_mask).sum().backward()
    grads = {name: p.grad for name, p in trained.named_parameters()}
    assert grads["lm_head.weight"] is not None and float(grads["lm_head.weight"].abs().sum()) > 0
    assert float(grads["model.embed_tokens.weight"].abs().sum()) > 0


def test_models_with_transformed_logits_are_refused(model: Any) -> None:
    capped = copy.deepcopy(model)
    capped.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        output_head(capped)
    with pytest.raises(TypeError, match="causal LM"):
        output_head(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_gradient_accumulation_equals_one_micro_batch(model: Any, mode: str) -> None:
    samples = random_samples(11, 6, model.config.vocab_size)
    batch = pad_samples(samples, pad_token_id=0)
    rng = torch.Generator().manual_seed(5)
    advantages = torch.randn(batch.responses.shape, generator=rng) * batch.response_mask
    old, _ = score_batch(model, batch, config=TrainerConfig())
    old = old - 0.05 * torch.rand(old.shape, generator=rng) * batch.response_mask  # ratio != 1
    results = []
    for micro in (6, 4, 1):
        trained = copy.deepcopy(model)
        optimizer = torch.optim.SGD(trained.parameters(), lr=0.5)
        config = TrainerConfig(micro_batch_size=micro, loss_agg_mode=mode, grad_clip=None)
        stats = ppo_update(trained, batch, optimizer=optimizer, old_log_probs=old,
                           advantages=advantages, config=config)
        assert stats.optimizer_steps == 1
        results.append((trained.state_dict(), stats.metrics()))
    reference, reference_metrics = results[0]
    for state, metrics in results[1:]:
        for name, tensor in reference.items():
            assert torch.allclose(state[name], tensor, atol=1e-6), name
        assert metrics["pg_loss"] == pytest.approx(reference_metrics["pg_loss"], abs=1e-6)
        assert metrics["pg_clipfrac"] == pytest.approx(reference_metrics["pg_clipfrac"])


def test_mini_batches_and_epochs_count_optimizer_steps(model: Any) -> None:
    batch = pad_samples(random_samples(12, 5, model.config.vocab_size), pad_token_id=0)
    old, _ = score_batch(model, batch, config=TrainerConfig())
    trained = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-3)
    calls = []
    stats = ppo_update(trained, batch, optimizer=optimizer, old_log_probs=old,
                       advantages=torch.ones_like(old) * batch.response_mask,
                       config=TrainerConfig(mini_batch_size=2, ppo_epochs=2),
                       between_steps=lambda: calls.append(1))
    assert stats.optimizer_steps == 6 and len(calls) == 6  # ceil(5 / 2) mini-batches x 2
    metrics = stats.metrics()
    assert metrics["ppo_kl"] != 0.0  # later mini-batches see a moved policy
    with pytest.raises(ValueError, match="ref_log_probs"):
        ppo_update(trained, batch, optimizer=optimizer, old_log_probs=old, advantages=old,
                   config=TrainerConfig(kl_coef=0.1))


def test_kl_to_reference_pulls_back(model: Any) -> None:
    """With only the KL term active (zero advantages), a moved policy steps back toward the
    reference: its KL to the reference falls."""
    batch = pad_samples(random_samples(13, 4, model.config.vocab_size), pad_token_id=0)
    ref, _ = score_batch(model, batch, config=TrainerConfig())
    moved = copy.deepcopy(model)
    with torch.no_grad():
        moved.lm_head.weight.add_(0.05 * torch.randn_like(moved.lm_head.weight))
    config = TrainerConfig(kl_coef=1.0, kl_kind="low_var_kl", grad_clip=None)

    def kl_now() -> float:
        lp, _ = score_batch(moved, batch, config=config)
        return float((kl_penalty(lp, ref, "low_var_kl") * batch.response_mask).sum())

    before = kl_now()
    old, _ = score_batch(moved, batch, config=config)
    optimizer = torch.optim.SGD(moved.parameters(), lr=0.01)
    stats = ppo_update(moved, batch, optimizer=optimizer, old_log_probs=old,
                       advantages=torch.zeros_like(old), config=config, ref_log_probs=ref)
    assert stats.metrics()["kl_loss"] > 0
    assert kl_now() < before
