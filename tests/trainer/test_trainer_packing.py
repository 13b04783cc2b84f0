"""Sequence packing on the tiny model: the packed scoring equals the padded one (values and
gradients), and a PPO update with packed micro-batches equals the padded update."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from workers.engines.tinymodel import tiny_model_path
from workers.trainer.batch import TrainingBatch, pad_samples
from workers.trainer.checkpoint import load_model
from workers.trainer.config import TrainerConfig
from workers.trainer.packing import PackedScoring, packed_response_log_probs
from workers.trainer.policy import response_log_probs
from workers.trainer.ppo import ppo_update, score_batch


@dataclasses.dataclass(frozen=True)
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


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_path(tmp_path_factory.mktemp("tiny"))


def batch_of(lengths: list[int], seed: int = 0) -> TrainingBatch:
    """Variable-length samples (a third prompt, the rest trained, some tokens masked)."""
    rng = np.random.default_rng(seed)
    samples = []
    for index, length in enumerate(lengths):
        prompt = max(1, length // 3)
        mask = np.zeros(length, dtype=np.int64)
        mask[prompt:] = rng.integers(0, 2, length - prompt) | (np.arange(length - prompt) == 0)
        samples.append(Sample(index, f"g{index // 2}", "positive", float(rng.random()), 0,
                              prompt, rng.integers(0, 768, length), mask,
                              -rng.random(length).astype(np.float32) * mask))
    return pad_samples(samples, pad_token_id=0, vocab_size=768)


def test_packed_scoring_equals_padded(model_path: Path) -> None:
    batch = batch_of([7, 41, 2, 23, 12])
    model = load_model(model_path)
    mask = batch.response_mask
    padded = response_log_probs(model, batch)
    (padded[0] * mask).sum().backward()
    padded_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    packed = packed_response_log_probs(model, batch)
    (packed[0] * mask).sum().backward()
    for ours, theirs in zip(packed, padded, strict=True):
        assert ours.shape == theirs.shape
        assert float(((ours - theirs).abs() * mask).max().detach()) < 1e-5
    for name, param in model.named_parameters():
        assert torch.allclose(param.grad, padded_grads[name], atol=1e-5), name
    # Without the block-diagonal mask, later samples would see earlier ones: the check above
    # would fail. Packing a single row changes nothing either.
    one = batch.select([1])
    assert torch.allclose(packed_response_log_probs(model, one)[0],
                          response_log_probs(model, one)[0], atol=1e-5)


def test_packed_update_equals_padded(model_path: Path) -> None:
    batch = batch_of([30, 5, 17, 44, 9, 26], seed=1)
    config = TrainerConfig(lr=1e-3, micro_batch_size=4)
    results = []
    for sharding in (None, PackedScoring()):
        model = load_model(model_path)
        # SGD: the weights move by the gradients themselves (Adam's first step is about
        # lr * sign(g), which blows rounding of near-zero gradients up to a whole step).
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        old, _ = score_batch(model, batch, config=config)
        advantages = torch.linspace(-1, 1, batch.response_mask.numel()).reshape(
            batch.response_mask.shape) * batch.response_mask
        stats = ppo_update(model, batch, optimizer=optimizer, old_log_probs=old,
                           advantages=advantages, config=config, sharding=sharding)
        results.append((stats.metrics(), model.state_dict()))
    (padded, padded_weights), (packed, packed_weights) = results
    assert packed["pg_loss"] == pytest.approx(padded["pg_loss"], abs=1e-6)
    assert packed["grad_norm"] == pytest.approx(padded["grad_norm"], rel=1e-5)
    assert max(float((packed_weights[k] - v).abs().max())
               for k, v in padded_weights.items()) < 1e-5
    initial = load_model(model_path).state_dict()
    assert max(float((packed_weights[k] - v).abs().max()) for k, v in initial.items()) > 1e-3


def test_packing_refuses_left_padding(model_path: Path) -> None:
    batch = batch_of([5, 9])
    flipped = dataclasses.replace(batch, attention_mask=batch.attention_mask.flip(1))
    with pytest.raises(ValueError, match="right-padded"):
        packed_response_log_probs(load_model(model_path), flipped)
