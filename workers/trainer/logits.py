"""Per-token log-probs and entropies from a language-model head, computed in chunks.

At training sizes the full logits are too large to hold as float32 (batch 8 x 4,096 tokens x a
151,936-token vocabulary is about 20 GB, and a naive log-softmax plus entropy holds several
tensors of that size). These functions walk over the tokens ``chunk_size`` rows at a time: each
chunk's logits are computed (from hidden states and the head weight, or sliced from precomputed
logits), upcast to float32, divided by the sampling temperature, and reduced to the target
token's log-prob and the distribution's entropy before the next chunk starts. Only
``(chunk_size, vocab)`` float32 tensors ever exist. The temperature is one number, or one per
row (``(bs,)``: a batch of samples drawn at different temperatures).

Autograd: when gradients are needed each chunk runs under activation checkpointing
(``torch.utils.checkpoint``, non-reentrant). The forward pass keeps only the chunk's inputs (views
of the hidden states and the head weight); the backward pass recomputes one chunk's logits at a
time, so backward peak memory is also chunk-sized (plus the gradients themselves, e.g. the head
weight's). Gradients flow to the hidden states, the head weight and bias, or the given logits,
through both outputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from workers.trainer.checks import require_finite_number, require_floating, require_tensor

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "logprobs_and_entropy_from_hidden",
    "logprobs_and_entropy_from_logits",
]

DEFAULT_CHUNK_SIZE = 1024
"""Tokens per chunk: 1,024 x 151,936 float32 logits are about 0.6 GB per temporary."""


def _upcast(tensor: torch.Tensor) -> torch.Tensor:
    """float32 for half-precision input; float64 input stays float64 (for exact checks)."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def _token_stats(
    log_probs: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(n, vocab)`` log-softmax output -> ``(n,)`` target log-probs and entropies.

    Without autograd the entropy terms are formed in place, so together with ``log_probs`` at
    most two ``(n, vocab)`` tensors are alive.
    """
    target_log_probs = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if torch.is_grad_enabled() and log_probs.requires_grad:
        entropies = -(log_probs.exp() * log_probs).sum(dim=-1)
    else:
        weighted = log_probs.exp()
        weighted.mul_(log_probs)
        entropies = -weighted.sum(dim=-1)
    return target_log_probs, entropies


Temperature = float | torch.Tensor
"""One temperature, or one per flattened token ``(n,)`` (see :func:`_check_temperature`)."""


def _hidden_chunk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: Temperature,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = _upcast(F.linear(hidden, weight, bias))
    if isinstance(temperature, torch.Tensor):
        logits = logits.div_(temperature.unsqueeze(-1).to(logits.dtype))
    elif temperature != 1.0:
        # The matmul/upcast output is a fresh tensor that no backward formula needs, so it may be
        # scaled in place even under autograd.
        logits = logits.div_(temperature)
    log_probs = torch.log_softmax(logits, dim=-1)
    del logits  # log_softmax keeps its output, not its input: free the logits now
    return _token_stats(log_probs, targets)


def _logits_chunk(
    logits: torch.Tensor, targets: torch.Tensor, temperature: Temperature
) -> tuple[torch.Tensor, torch.Tensor]:
    # The upcast returns the caller's own tensor when it is float32 already: never in place.
    if isinstance(temperature, torch.Tensor):
        scaled = _upcast(logits) / temperature.unsqueeze(-1).to(_upcast(logits).dtype)
    else:
        scaled = _upcast(logits) if temperature == 1.0 else _upcast(logits) / temperature
    log_probs = torch.log_softmax(scaled, dim=-1)
    del scaled
    return _token_stats(log_probs, targets)


def _run_chunked(
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    chunk_args: Callable[[int, int], tuple[object, ...]],
    *,
    rows: int,
    chunk_size: int,
    needs_grad: bool,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate ``fn(*chunk_args(start, stop))`` over ``[0, rows)``, ``chunk_size`` at a time."""
    log_prob_parts: list[torch.Tensor] = []
    entropy_parts: list[torch.Tensor] = []
    for start in range(0, rows, chunk_size):
        args = chunk_args(start, min(start + chunk_size, rows))
        if needs_grad:
            log_probs, entropies = checkpoint(fn, *args, use_reentrant=False)
        else:
            log_probs, entropies = fn(*args)
        log_prob_parts.append(log_probs)
        entropy_parts.append(entropies)
    if not log_prob_parts:
        empty = torch.empty(0, dtype=torch.float32, device=device)
        return empty, empty.clone()
    return torch.cat(log_prob_parts), torch.cat(entropy_parts)


def _wants_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _check_temperature(temperature: object, leading_shape: torch.Size,
                       device: torch.device) -> Temperature:
    """A number (> 0, finite), or a ``(bs,)`` tensor of them: returned as a float when every
    row has the same one (the usual case: the plain scalar path), else as one temperature per
    flattened token ``(bs * seq,)``."""
    if not isinstance(temperature, torch.Tensor):
        return require_finite_number("temperature", temperature, minimum=0.0,
                                     minimum_inclusive=False)
    if tuple(temperature.shape) != tuple(leading_shape[:1]):
        raise ValueError(f"temperature must be a number or one per row, shape "
                         f"({leading_shape[0]},), got shape {tuple(temperature.shape)}")
    values = temperature.detach().to(torch.float64)
    if not bool(torch.isfinite(values).all()) or not bool((values > 0).all()):
        raise ValueError(f"temperature must be finite and > 0 in every row, got "
                         f"{values.tolist()}")
    if values.numel() == 0 or bool((values == values[0]).all()):
        return float(values[0]) if values.numel() else 1.0
    per_row = temperature.detach().to(device=device, dtype=torch.float32)
    return per_row.repeat_interleave(int(leading_shape[1]))


def _temperature_slice(temperature: Temperature, start: int, stop: int) -> Temperature:
    return temperature[start:stop] if isinstance(temperature, torch.Tensor) else temperature


def _check_common(
    targets: object, leading_shape: torch.Size, vocab: int, temperature: object, chunk_size: object
) -> tuple[torch.Tensor, Temperature, int]:
    target_ids = require_tensor("targets", targets)
    if target_ids.is_floating_point() or target_ids.is_complex() or target_ids.dtype == torch.bool:
        raise TypeError(f"targets must hold integer token ids, got dtype {target_ids.dtype}")
    if target_ids.shape != leading_shape:
        raise ValueError(
            f"targets has shape {tuple(target_ids.shape)} but must match the leading dimensions "
            f"{tuple(leading_shape)} of the hidden states / logits"
        )
    temp = _check_temperature(temperature, leading_shape, target_ids.device)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(
            f"chunk_size must be an int, got {type(chunk_size).__name__} {chunk_size!r}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if target_ids.numel():
        low, high = int(target_ids.min().item()), int(target_ids.max().item())
        if low < 0 or high >= vocab:
            raise ValueError(
                f"targets must lie in [0, {vocab}) (the vocabulary), got values in [{low}, {high}]"
            )
    return target_ids.reshape(-1).to(torch.long), temp, chunk_size


def _check_outputs(log_probs: torch.Tensor, entropies: torch.Tensor) -> None:
    bad = ~(torch.isfinite(log_probs) & torch.isfinite(entropies))
    if bool(bad.any()):
        rows = torch.nonzero(bad).flatten()[:10].tolist()
        raise ValueError(
            f"non-finite log-prob or entropy at flattened token positions {rows}; "
            "the logits there are not finite"
        )


def logprobs_and_entropy_from_hidden(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    lm_head_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target token and the entropy of each distribution, both ``(bs, seq)``.

    ``hidden_states`` is ``(bs, seq, hidden)`` (the final hidden states, any float dtype),
    ``lm_head_weight`` ``(vocab, hidden)`` and ``lm_head_bias`` ``(vocab,)`` or None,
    ``targets`` ``(bs, seq)`` token ids: position ``t`` holds the token that the distribution
    at ``t`` is scored on (the caller shifts by one). Logits are
    ``(hidden @ weight.T + bias) / temperature`` in float32 (``temperature`` a number or one
    per row, ``(bs,)``), computed ``chunk_size`` tokens at a time; outputs are float32
    (float64 for float64 inputs). Equal to the naive full-tensor computation up to float
    rounding.

    Raises TypeError/ValueError (naming the argument) for non-tensors, wrong ranks or shapes,
    non-float hidden states or weight, non-integer targets or targets outside the vocabulary,
    a non-positive or non-finite temperature, a chunk size below 1, and non-finite results.
    """
    hidden = require_tensor("hidden_states", hidden_states)
    weight = require_tensor("lm_head_weight", lm_head_weight)
    require_floating("hidden_states", hidden)
    require_floating("lm_head_weight", weight)
    if hidden.dim() != 3:
        raise ValueError(
            f"hidden_states must have shape (bs, seq, hidden), got {tuple(hidden.shape)}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[2]:
        raise ValueError(
            f"lm_head_weight must have shape (vocab, {hidden.shape[2]}), got {tuple(weight.shape)}"
        )
    if lm_head_bias is not None:
        require_tensor("lm_head_bias", lm_head_bias)
        if tuple(lm_head_bias.shape) != (weight.shape[0],):
            raise ValueError(
                f"lm_head_bias must have shape ({weight.shape[0]},), "
                f"got {tuple(lm_head_bias.shape)}"
            )
    target_ids, temp, chunk = _check_common(
        targets, hidden.shape[:2], weight.shape[0], temperature, chunk_size
    )
    bs, seq = hidden.shape[:2]
    flat_hidden = hidden.reshape(bs * seq, hidden.shape[2])
    log_probs, entropies = _run_chunked(
        _hidden_chunk,
        lambda start, stop: (
            flat_hidden[start:stop],
            weight,
            lm_head_bias,
            target_ids[start:stop],
            _temperature_slice(temp, start, stop),
        ),
        rows=bs * seq,
        chunk_size=chunk,
        needs_grad=_wants_grad(hidden, weight, lm_head_bias),
        device=hidden.device,
    )
    _check_outputs(log_probs, entropies)
    return log_probs.reshape(bs, seq), entropies.reshape(bs, seq)


def logprobs_and_entropy_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target and entropy per position from ``(bs, seq, vocab)`` logits
    (``temperature`` a number or one per row, ``(bs,)``).

    ``targets`` is ``(bs, seq)``. Each chunk of ``chunk_size`` positions is upcast to float32,
    divided by ``temperature`` and log-softmaxed on its own, so no float32 copy of the whole
    logits tensor (which may be bfloat16) is made; outputs are ``(bs, seq)`` float32 (float64
    for float64 logits). The input is never modified.

    Raises TypeError/ValueError (naming the argument) for a non-tensor, non-float or non-3-D
    ``logits``, mismatched or out-of-vocabulary ``targets``, a non-positive or non-finite
    temperature, a chunk size below 1, and non-finite results (e.g. ``-inf`` logits).
    """
    scores = require_tensor("logits", logits)
    require_floating("logits", scores)
    if scores.dim() != 3:
        raise ValueError(f"logits must have shape (bs, seq, vocab), got {tuple(scores.shape)}")
    target_ids, temp, chunk = _check_common(
        targets, scores.shape[:2], scores.shape[2], temperature, chunk_size
    )
    bs, seq, vocab = scores.shape
    flat_scores = scores.reshape(bs * seq, vocab)
    log_probs, entropies = _run_chunked(
        _logits_chunk,
        lambda start, stop: (flat_scores[start:stop], target_ids[start:stop],
                             _temperature_slice(temp, start, stop)),
        rows=bs * seq,
        chunk_size=chunk,
        needs_grad=_wants_grad(scores),
        device=scores.device,
    )
    _check_outputs(log_probs, entropies)
    return log_probs.reshape(bs, seq), entropies.reshape(bs, seq)
