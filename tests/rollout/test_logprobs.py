"""Sampling-distribution logprobs: the vectorised function against a plain loop reference."""

from __future__ import annotations

import math

import pytest
import torch

from workers.engines.logprobs import sampled_token_logprobs, sampling_log_softmax


def reference_log_softmax(logits: list[list[float]], temperature: float, top_p: float
                          ) -> list[list[float]]:
    """Row by row, token by token: scale, keep the nucleus, renormalise."""
    rows = []
    for row in logits:
        scaled = [x / temperature for x in row] if temperature > 0 else list(row)
        if temperature > 0 and top_p < 1:
            peak = max(scaled)
            probs = [math.exp(x - peak) for x in scaled]
            total = sum(probs)
            probs = [p / total for p in probs]
            order = sorted(range(len(row)), key=lambda i: probs[i])  # ascending
            cumulative, dropped = 0.0, set()
            for position, index in enumerate(order):
                cumulative += probs[index]
                if cumulative <= 1 - top_p and position < len(order) - 1:
                    dropped.add(index)
            scaled = [float("-inf") if i in dropped else x for i, x in enumerate(scaled)]
        peak = max(scaled)
        log_total = peak + math.log(sum(math.exp(x - peak) for x in scaled
                                        if x != float("-inf")))
        rows.append([x - log_total if x != float("-inf") else float("-inf") for x in scaled])
    return rows


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 1.0), (0.8, 0.9),
                                                    (1.3, 0.5), (0.0, 0.3)])
def test_vectorised_equals_loop_reference(seed: int, temperature: float, top_p: float) -> None:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 40, generator=generator, dtype=torch.float64) * 3
    fast = sampling_log_softmax(logits, temperature=temperature, top_p=top_p)
    slow = torch.tensor(reference_log_softmax(logits.tolist(), temperature, top_p),
                        dtype=torch.float32)
    assert torch.equal(torch.isinf(fast), torch.isinf(slow))
    finite = ~torch.isinf(slow)
    assert torch.allclose(fast[finite], slow[finite], atol=1e-5)
    # Each row is a distribution over its nucleus, which holds the most likely token.
    assert torch.allclose(fast.exp().sum(-1), torch.ones(6), atol=1e-5)
    assert torch.isfinite(fast.gather(-1, logits.argmax(-1, keepdim=True))).all()


def test_gathered_logprobs_and_errors() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])
    tokens = torch.tensor([2, 0])
    values = sampled_token_logprobs(logits, tokens, temperature=1.0)
    assert torch.allclose(values, torch.log_softmax(logits, -1)[[0, 1], [2, 0]])
    with pytest.raises(ValueError, match="token_ids must have shape"):
        sampled_token_logprobs(logits, torch.tensor([1]), temperature=1.0)
    with pytest.raises(ValueError, match="token_ids must lie in"):
        sampled_token_logprobs(logits, torch.tensor([1, 3]), temperature=1.0)
    with pytest.raises(ValueError, match="temperature"):
        sampling_log_softmax(logits, temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        sampling_log_softmax(logits, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="shape"):
        sampling_log_softmax(logits[0], temperature=1.0)
