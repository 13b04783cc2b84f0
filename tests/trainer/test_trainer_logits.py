"""Chunked log-probs and entropies: equal to the naive full-tensor computation (values and
gradients), no chunk-sized tensor kept for backward, bad input."""

from __future__ import annotations

import pytest
import torch
from trainer_loop_reference import naive_logprobs_entropy

from workers.trainer.logits import (
    logprobs_and_entropy_from_hidden,
    logprobs_and_entropy_from_logits,
)

BS, SEQ, HIDDEN, VOCAB = 3, 11, 16, 97


def make(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "hidden": torch.randn(BS, SEQ, HIDDEN, generator=gen, dtype=dtype),
        "weight": (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.7).to(dtype),
        "bias": torch.randn(VOCAB, generator=gen).to(dtype),
        "targets": torch.randint(0, VOCAB, (BS, SEQ), generator=gen),
    }


def naive_from_hidden(
    x: dict[str, torch.Tensor], temperature: float, *, bias: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.nn.functional.linear(x["hidden"], x["weight"], x["bias"] if bias else None)
    return naive_logprobs_entropy(logits, x["targets"], temperature)


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 33, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
@pytest.mark.parametrize("bias", [False, True])
def test_hidden_equals_naive(chunk_size: int, temperature: float, bias: bool) -> None:
    x = make(chunk_size)
    log_probs, entropy = logprobs_and_entropy_from_hidden(
        x["hidden"],
        x["weight"],
        x["targets"],
        temperature=temperature,
        chunk_size=chunk_size,
        lm_head_bias=x["bias"] if bias else None,
    )
    expected_lp, expected_h = naive_from_hidden(x, temperature, bias=bias)
    assert log_probs.shape == entropy.shape == (BS, SEQ)
    assert log_probs.dtype == entropy.dtype == torch.float32
    torch.testing.assert_close(log_probs, expected_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, expected_h, atol=1e-5, rtol=1e-5)
    assert bool((entropy > 0).all()) and bool((log_probs < 0).all())


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 1000])
def test_one_temperature_per_row_equals_each_row_alone(chunk_size: int) -> None:
    """Rows sampled at different temperatures are each scored at their own, values and
    gradients; a tensor of equal temperatures is the scalar case exactly."""
    x = make(5)
    temps = torch.tensor([0.7, 1.0, 1.6], dtype=torch.float64)
    hidden = x["hidden"].clone().requires_grad_(True)
    log_probs, entropy = logprobs_and_entropy_from_hidden(
        hidden, x["weight"], x["targets"], temperature=temps, chunk_size=chunk_size)
    (log_probs.sum() + entropy.sum()).backward()
    for row, temperature in enumerate(temps.tolist()):
        alone = hidden.detach()[row:row + 1].clone().requires_grad_(True)
        lp, h = logprobs_and_entropy_from_hidden(alone, x["weight"], x["targets"][row:row + 1],
                                                 temperature=temperature, chunk_size=chunk_size)
        (lp.sum() + h.sum()).backward()
        torch.testing.assert_close(log_probs[row:row + 1], lp, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(entropy[row:row + 1], h, atol=1e-6, rtol=1e-6)
        assert hidden.grad is not None and alone.grad is not None
        torch.testing.assert_close(hidden.grad[row:row + 1], alone.grad, atol=1e-6, rtol=1e-6)
    logits = torch.nn.functional.linear(x["hidden"], x["weight"])
    by_row = logprobs_and_entropy_from_logits(logits, x["targets"], temperature=temps,
                                              chunk_size=chunk_size)
    torch.testing.assert_close(by_row[0], log_probs.detach(), atol=1e-5, rtol=1e-5)
    same = logprobs_and_entropy_from_hidden(x["hidden"], x["weight"], x["targets"],
                                            temperature=torch.full((BS,), 0.7))
    plain = logprobs_and_entropy_from_hidden(x["hidden"], x["weight"], x["targets"],
                                             temperature=float(torch.tensor(0.7)))
    assert torch.equal(same[0], plain[0]) and torch.equal(same[1], plain[1])


@pytest.mark.parametrize(("temperature", "match"), [
    (torch.tensor([0.7, 1.0]), r"one per row, shape \(3,\)"),
    (torch.tensor([0.7, 0.0, 1.0]), "finite and > 0 in every row"),
    (torch.tensor([0.7, float("nan"), 1.0]), "finite and > 0 in every row"),
])
def test_bad_per_row_temperatures(temperature: torch.Tensor, match: str) -> None:
    x = make(0)
    with pytest.raises(ValueError, match=match):
        logprobs_and_entropy_from_hidden(x["hidden"], x["weight"], x["targets"],
                                         temperature=temperature)


@pytest.mark.parametrize("chunk_size", [1, 5, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logits_equals_naive_and_leaves_input_alone(chunk_size: int, temperature: float) -> None:
    x = make(1)
    logits = torch.nn.functional.linear(x["hidden"], x["weight"])
    before = logits.clone()
    log_probs, entropy = logprobs_and_entropy_from_logits(
        logits, x["targets"], temperature=temperature, chunk_size=chunk_size
    )
    expected_lp, expected_h = naive_logprobs_entropy(logits, x["targets"], temperature)
    torch.testing.assert_close(log_probs, expected_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, expected_h, atol=1e-5, rtol=1e-5)
    assert torch.equal(logits, before)


def test_bfloat16_inputs_are_upcast_per_chunk() -> None:
    x = make(2, dtype=torch.bfloat16)
    log_probs, entropy = logprobs_and_entropy_from_hidden(
        x["hidden"], x["weight"], x["targets"], temperature=0.7, chunk_size=8
    )
    assert log_probs.dtype == torch.float32
    logits = torch.nn.functional.linear(x["hidden"], x["weight"])  # bf16 logits, then float32
    expected_lp, expected_h = naive_logprobs_entropy(logits, x["targets"], 0.7)
    torch.testing.assert_close(log_probs, expected_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, expected_h, atol=1e-5, rtol=1e-5)
    lp2, h2 = logprobs_and_entropy_from_logits(logits, x["targets"], temperature=0.7, chunk_size=3)
    torch.testing.assert_close(lp2, expected_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h2, expected_h, atol=1e-5, rtol=1e-5)


def weighted_objective(log_probs: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    w1 = torch.randn(log_probs.shape, generator=gen, dtype=log_probs.dtype)
    w2 = torch.randn(entropy.shape, generator=gen, dtype=entropy.dtype)
    return (w1 * log_probs).sum() + (w2 * entropy).sum()


@pytest.mark.parametrize("chunk_size", [1, 6, 1000])
def test_hidden_gradients_equal_naive(chunk_size: int) -> None:
    x = make(3)
    leaves = {k: x[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")}
    log_probs, entropy = logprobs_and_entropy_from_hidden(
        leaves["hidden"],
        leaves["weight"],
        x["targets"],
        temperature=0.8,
        chunk_size=chunk_size,
        lm_head_bias=leaves["bias"],
    )
    weighted_objective(log_probs, entropy).backward()
    naive_leaves = {k: x[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")}
    expected_lp, expected_h = naive_from_hidden({**x, **naive_leaves}, 0.8, bias=True)
    weighted_objective(expected_lp, expected_h).backward()
    for name in leaves:
        got, expected = leaves[name].grad, naive_leaves[name].grad
        assert got is not None and expected is not None
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_logits_gradients_equal_naive() -> None:
    x = make(4)
    logits = torch.nn.functional.linear(x["hidden"], x["weight"]).detach()
    mine = logits.clone().requires_grad_(True)
    theirs = logits.clone().requires_grad_(True)
    weighted_objective(
        *logprobs_and_entropy_from_logits(mine, x["targets"], temperature=1.2, chunk_size=4)
    ).backward()
    weighted_objective(*naive_logprobs_entropy(theirs, x["targets"], 1.2)).backward()
    assert mine.grad is not None and theirs.grad is not None
    torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-6, rtol=1e-5)


def test_gradcheck_float64() -> None:
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 6, (2, 3), generator=gen)

    def fn(h: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return logprobs_and_entropy_from_hidden(h, w, targets, temperature=0.9, chunk_size=2)

    assert torch.autograd.gradcheck(fn, (hidden, weight))


def test_no_chunk_sized_tensor_is_kept_for_backward() -> None:
    """Under autograd the forward pass may keep only inputs (hidden chunks, the weight): a kept
    ``(chunk, vocab)`` tensor per chunk would add up to the full logits."""
    x = make(6)
    hidden = x["hidden"].clone().requires_grad_(True)
    weight = x["weight"].clone().requires_grad_(True)
    chunk = 4
    kept: list[tuple[int, ...]] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        kept.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        log_probs, entropy = logprobs_and_entropy_from_hidden(
            hidden, weight, x["targets"], chunk_size=chunk
        )
    assert kept  # the hook does see what checkpointing keeps
    assert (VOCAB, HIDDEN) in kept and (chunk, HIDDEN) in kept
    assert all(shape[-1] != VOCAB for shape in kept), kept  # no logits-like tensor
    (log_probs.sum() + entropy.sum()).backward()
    assert hidden.grad is not None and weight.grad is not None

    # The same hook does see (chunk, vocab) tensors when checkpointing is bypassed.
    kept.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        naive_from_hidden({**x, "hidden": hidden, "weight": weight}, 1.0, bias=False)
    assert (BS, SEQ, VOCAB) in kept


def test_no_grad_path_needs_no_autograd() -> None:
    x = make(8)
    with torch.no_grad():
        log_probs, entropy = logprobs_and_entropy_from_hidden(
            x["hidden"].requires_grad_(True), x["weight"], x["targets"], chunk_size=5
        )
    assert not log_probs.requires_grad and not entropy.requires_grad


def test_uniform_logits_have_log_vocab_entropy() -> None:
    logits = torch.zeros(1, 2, 50)
    log_probs, entropy = logprobs_and_entropy_from_logits(logits, torch.tensor([[3, 49]]))
    torch.testing.assert_close(entropy, torch.full((1, 2), float(torch.log(torch.tensor(50.0)))))
    torch.testing.assert_close(log_probs, -torch.full((1, 2), float(torch.log(torch.tensor(50.0)))))


def test_empty_sequence() -> None:
    log_probs, entropy = logprobs_and_entropy_from_hidden(
        torch.zeros(2, 0, HIDDEN), torch.zeros(VOCAB, HIDDEN), torch.zeros(2, 0, dtype=torch.long)
    )
    assert log_probs.shape == entropy.shape == (2, 0)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"temperature": 0.0}, ValueError, "temperature must be > 0"),
        ({"temperature": -1.0}, ValueError, "temperature must be > 0"),
        ({"temperature": float("inf")}, ValueError, "temperature must be finite"),
        ({"temperature": "hot"}, TypeError, "temperature must be a real number"),
        ({"chunk_size": 0}, ValueError, "chunk_size must be >= 1"),
        ({"chunk_size": 2.5}, TypeError, "chunk_size must be an int"),
        ({"targets": torch.full((BS, SEQ), VOCAB)}, ValueError, r"targets must lie in \[0, 97\)"),
        ({"targets": torch.full((BS, SEQ), -1)}, ValueError, "targets must lie in"),
        ({"targets": torch.zeros(BS, SEQ + 1, dtype=torch.long)}, ValueError, "targets has shape"),
        ({"targets": torch.zeros(BS, SEQ)}, TypeError, "targets must hold integer token ids"),
        ({"hidden_states": torch.zeros(BS * SEQ, HIDDEN)}, ValueError, "hidden_states must have"),
        ({"lm_head_weight": torch.zeros(VOCAB, HIDDEN + 1)}, ValueError, "lm_head_weight must"),
        ({"lm_head_bias": torch.zeros(VOCAB + 1)}, ValueError, "lm_head_bias must have shape"),
        ({"hidden_states": torch.zeros(BS, SEQ, HIDDEN, dtype=torch.long)}, TypeError, "floating"),
        ({"lm_head_weight": None}, TypeError, "lm_head_weight must be a torch.Tensor"),
    ],
)
def test_hidden_bad_input(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    x = make(0)
    args: dict[str, object] = {
        "hidden_states": x["hidden"],
        "lm_head_weight": x["weight"],
        "targets": x["targets"],
    }
    args.update(kwargs)
    with pytest.raises(error, match=match):
        logprobs_and_entropy_from_hidden(**args)  # type: ignore[arg-type]


def test_logits_bad_input() -> None:
    targets = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="logits must have shape"):
        logprobs_and_entropy_from_logits(torch.zeros(2, 5), targets)
    with pytest.raises(TypeError, match="logits must be a floating-point"):
        logprobs_and_entropy_from_logits(torch.zeros(1, 2, 5, dtype=torch.long), targets)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        logprobs_and_entropy_from_logits(torch.zeros(1, 2, 5), targets, temperature=0)
    bad = torch.zeros(1, 2, 5)
    bad[0, 1, 3] = float("nan")
    with pytest.raises(
        ValueError,
        match=r"non-finite log-prob or entropy at flattened token "
        r"positions \[1\]",
    ):
        logprobs_and_entropy_from_logits(bad, targets)
