"""Padding samples into tensors and placing rewards, against plain-loop references."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

from workers.trainer.batch import pad_samples, token_level_rewards
from workers.trainer.ppo import trim

PAD = 0


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


def random_sample(rng: random.Random, sample_id: int) -> Sample:
    """A multi-turn-like sample: prompt, then generated spans separated by context spans."""
    prompt = rng.randint(1, 9)
    spans = []
    for _ in range(rng.randint(1, 3)):
        spans.append([1] * rng.randint(1, 6))
        if rng.random() < 0.5:
            spans.append([0] * rng.randint(1, 4))
    mask = [0] * prompt + [m for span in spans for m in span]
    n = len(mask)
    return Sample(
        sample_id=sample_id, group_id=f"g{rng.randint(0, 2)}",
        kind=rng.choice(["positive", "positive", "negative"]), reward=rng.uniform(-1, 1),
        policy_version=rng.choice([None, 0, 3]), prompt_length=prompt,
        token_ids=np.array([rng.randint(1, 99) for _ in range(n)], dtype=np.int32),
        loss_mask=np.array(mask, dtype=np.uint8),
        logprobs=np.array([-rng.random() if m else 0.0 for m in mask], dtype=np.float32))


def loop_pad(samples: list[Sample]) -> dict[str, list[list[float]]]:
    """Row by row: right-padded sequences; responses from prompt_length on; the position
    scoring response token j is prompt_length - 1 + j (padding positions clamped)."""
    seq = max(len(s.token_ids) for s in samples)
    length = max(max(len(s.token_ids) - s.prompt_length for s in samples), 1)
    out: dict[str, list[list[float]]] = {k: [] for k in (
        "input_ids", "attention_mask", "responses", "response_positions", "response_mask",
        "rollout_log_probs")}
    for s in samples:
        ids = [int(t) for t in s.token_ids]
        out["input_ids"].append(ids + [PAD] * (seq - len(ids)))
        out["attention_mask"].append([1] * len(ids) + [0] * (seq - len(ids)))
        response = ids[s.prompt_length:]
        mask = [int(m) for m in s.loss_mask[s.prompt_length:]]
        logp = [float(v) if m else 0.0 for v, m in zip(s.logprobs[s.prompt_length:], mask,
                                                       strict=True)]
        pad = length - len(response)
        out["responses"].append(response + [PAD] * pad)
        out["response_mask"].append(mask + [0] * pad)
        out["rollout_log_probs"].append(logp + [0.0] * pad)
        out["response_positions"].append(
            [min(s.prompt_length - 1 + j, seq - 1) for j in range(length)])
    return out


def loop_token_rewards(rewards: list[float], masks: list[list[int]], lengths: list[int]
                       ) -> list[list[float]]:
    out = []
    for reward, mask, length in zip(rewards, masks, lengths, strict=True):
        row = [0.0] * len(mask)
        trained = [j for j, m in enumerate(mask) if m]
        where = trained[-1] if trained else max(min(length - 1, len(mask) - 1), 0)
        row[where] = reward
        out.append(row)
    return out


@pytest.mark.parametrize("seed", range(8))
def test_pad_matches_loop_reference(seed: int) -> None:
    rng = random.Random(seed)
    samples = [random_sample(rng, i) for i in range(rng.randint(1, 7))]
    batch = pad_samples(samples, pad_token_id=PAD)
    expected = loop_pad(samples)
    for name, rows in expected.items():
        got = getattr(batch, name)
        assert torch.equal(got, torch.tensor(rows, dtype=got.dtype)), name
    assert batch.response_lengths.tolist() == [len(s.token_ids) - s.prompt_length
                                               for s in samples]
    assert batch.rewards.tolist() == pytest.approx([s.reward for s in samples])
    assert batch.is_negative.tolist() == [s.kind == "negative" for s in samples]
    assert batch.group_ids == tuple(s.group_id for s in samples)
    assert batch.sample_ids == tuple(s.sample_id for s in samples)
    assert batch.num_trainable_tokens == sum(int(s.loss_mask.sum()) for s in samples)
    # The scoring position of every real response token holds the token before it.
    for row, s in enumerate(samples):
        for j in range(len(s.token_ids) - s.prompt_length):
            position = int(batch.response_positions[row, j])
            assert batch.input_ids[row, position + 1] == batch.responses[row, j]


@pytest.mark.parametrize("seed", range(8))
def test_token_level_rewards_match_loop_reference(seed: int) -> None:
    rng = random.Random(100 + seed)
    bs, length = rng.randint(1, 6), rng.randint(1, 9)
    masks = [[int(rng.random() < 0.4) for _ in range(length)] for _ in range(bs)]
    lengths = [rng.randint(0, length) for _ in range(bs)]
    rewards = [rng.uniform(-2, 2) for _ in range(bs)]
    got = token_level_rewards(torch.tensor(rewards), torch.tensor(masks, dtype=torch.float32),
                              response_lengths=torch.tensor(lengths))
    expected = torch.tensor(loop_token_rewards(rewards, masks, lengths), dtype=torch.float32)
    assert torch.equal(got, expected)
    assert got.sum(dim=1).tolist() == pytest.approx(rewards)


def test_select_and_trim_keep_rows_consistent() -> None:
    rng = random.Random(7)
    samples = [random_sample(rng, i) for i in range(5)]
    batch = pad_samples(samples, pad_token_id=PAD)
    part = trim(batch.select([3, 1]))
    expected = trim(pad_samples([samples[3], samples[1]], pad_token_id=PAD))
    for name in ("input_ids", "attention_mask", "responses", "response_positions",
                 "response_mask", "rollout_log_probs"):
        assert torch.equal(getattr(part, name), getattr(expected, name)), name
    assert part.sample_ids == (3, 1)
    with pytest.raises(IndexError, match="rows must lie in"):
        batch.select([5])


def test_bad_samples_are_named() -> None:
    rng = random.Random(1)
    good = random_sample(rng, 0)
    n = len(good.token_ids)
    with pytest.raises(ValueError, match="must not be empty"):
        pad_samples([], pad_token_id=PAD)
    with pytest.raises(ValueError, match="pad_token_id"):
        pad_samples([good], pad_token_id=-1)
    cases = [
        (replace(good, loss_mask=good.loss_mask[:-1]), ValueError, r"samples\[1\].*equal"),
        (replace(good, token_ids=good.token_ids.astype(np.float32)), TypeError, "integers"),
        (replace(good, token_ids=good.token_ids.reshape(1, -1)), ValueError, "one-dimensional"),
        (replace(good, prompt_length=0), ValueError, "prompt_length must be in"),
        (replace(good, prompt_length=n + 1), ValueError, "prompt_length must be in"),
        (replace(good, loss_mask=np.ones(n, dtype=np.uint8)), ValueError, "before prompt"),
        (replace(good, loss_mask=np.full(n, 2, dtype=np.uint8)), ValueError, "only 0 and 1"),
        (replace(good, reward=float("nan")), ValueError, "reward must be finite"),
        (replace(good, reward=None), TypeError, "reward must be a number"),
    ]
    for bad, error, message in cases:
        with pytest.raises(error, match=message):
            pad_samples([good, bad], pad_token_id=PAD)
    with pytest.raises(ValueError, match=r"token_ids must lie in \[0, 50\)"):
        pad_samples([good], pad_token_id=PAD, vocab_size=50)


def test_token_level_rewards_refuses_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="rewards and response_lengths"):
        token_level_rewards(torch.zeros(2), torch.zeros(2, 3),
                            response_lengths=torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="response_mask must have shape"):
        token_level_rewards(torch.zeros(2), torch.zeros(3, 3),
                            response_lengths=torch.zeros(2, dtype=torch.long))
