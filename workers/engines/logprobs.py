"""Log-probabilities under the sampling distribution (temperature, then top-p nucleus).

This is the one definition of "the logprob of a sampled token" used by every backend (see
:mod:`workers.engines.backend`): ``log_softmax(logits / temperature)`` with the tokens outside
the top-p nucleus masked to ``-inf`` and the rest renormalised. The nucleus rule is the one of
vLLM and transformers: sort probabilities ascending, drop the tokens whose cumulative
probability is ``<= 1 - top_p``, always keep the most likely token. Greedy decoding
(``temperature == 0``) uses the unscaled, untruncated distribution.
"""

from __future__ import annotations

import math

import torch

__all__ = ["sampling_log_softmax", "sampled_token_logprobs"]


def _check(temperature: float, top_p: float) -> None:
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be finite and >= 0, got {temperature!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


def sampling_log_softmax(
    logits: torch.Tensor, *, temperature: float, top_p: float = 1.0
) -> torch.Tensor:
    """Log-probabilities ``(n, vocab)`` float32 of the sampling distribution for ``(n, vocab)``
    logits. Tokens outside the nucleus get ``-inf``. Raises ValueError for a negative or
    non-finite temperature, a ``top_p`` outside (0, 1] or logits that are not 2-D."""
    _check(temperature, top_p)
    if logits.dim() != 2:
        raise ValueError(f"logits must have shape (n, vocab), got {tuple(logits.shape)}")
    scaled = logits.float()
    if temperature == 0:
        return scaled.log_softmax(dim=-1)
    scaled = scaled / temperature
    if top_p < 1:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= (1 - top_p)
        drop_sorted[:, -1] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled.log_softmax(dim=-1)


def sampled_token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, *, temperature: float, top_p: float = 1.0
) -> torch.Tensor:
    """Log-probability ``(n,)`` float32 of ``token_ids`` ``(n,)`` under the sampling
    distribution of ``logits`` ``(n, vocab)``. Raises ValueError when the lengths differ or an
    id is outside the vocabulary (and as :func:`sampling_log_softmax`)."""
    if token_ids.dim() != 1 or token_ids.shape[0] != logits.shape[0]:
        raise ValueError(f"token_ids must have shape ({logits.shape[0]},), "
                         f"got {tuple(token_ids.shape)}")
    if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= logits.shape[-1]):
        raise ValueError(f"token_ids must lie in [0, {logits.shape[-1]}), got min "
                         f"{int(token_ids.min())} max {int(token_ids.max())}")
    logprobs = sampling_log_softmax(logits, temperature=temperature, top_p=top_p)
    return logprobs.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)
