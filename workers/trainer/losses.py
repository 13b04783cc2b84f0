"""PPO clipped policy loss (verl 0.9.1 ``compute_policy_loss_vanilla``) and the actor loss terms.

The actor loss is ``pg_loss - entropy_coeff * entropy_loss + kl_coef * kl_loss``, each term
aggregated with the same ``loss_agg_mode`` (see :mod:`workers.trainer.aggregation`), as verl's
actor does. :func:`agg_loss`, :func:`kl_penalty` and :func:`masked_mean` are re-exported here
for callers that think of them as losses.
"""

from __future__ import annotations

import torch

from workers.trainer.aggregation import GlobalBatchInfo, agg_loss, masked_mean
from workers.trainer.checks import (
    require_2d,
    require_finite_number,
    require_floating,
    require_same_shape,
    require_tensor,
)
from workers.trainer.kl import kl_penalty

__all__ = [
    "GlobalBatchInfo",
    "actor_loss",
    "agg_loss",
    "entropy_loss",
    "kl_loss",
    "kl_penalty",
    "masked_mean",
    "ppo_policy_loss",
]

# verl clamps the log-ratio before exponentiating so a stale sample cannot overflow exp().
_LOG_RATIO_BOUND = 20.0


def ppo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    global_batch: GlobalBatchInfo | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped PPO surrogate with dual clip; returns ``(loss, metrics)``.

    All four tensors are ``(bs, response_length)``; gradients flow through ``log_prob``. Per
    token, with ``r = exp(clamp(log_prob - old_log_prob, -20, 20))``:
    ``l = max(-A*r, -A*clip(r, 1-clip_ratio_low, 1+clip_ratio_high))``, and for ``A < 0`` the
    dual clip ``min(l, -A*clip_ratio_c)``. The token losses, multiplied by ``is_weights`` when
given (off-policy correction weights, ``(bs, response_length)``, no gradient; verl's
``rollout_is_weights``), are aggregated by ``loss_agg_mode``.

    ``metrics`` (floats, masked means over the response): ``pg_clipfrac`` (fraction of tokens
    where the clipped term is the larger), ``ppo_kl`` (mean of ``old_log_prob - log_prob``),
    ``pg_clipfrac_lower`` (fraction of negative-advantage tokens hit by the dual clip).

    Raises TypeError/ValueError (naming the argument) for non-tensors, tensors that are not 2-D
    or differ in shape, non-float log-probs or advantages, ``clip_ratio_low`` outside [0, 1),
    a negative ``clip_ratio_high``, ``clip_ratio_c <= 1``, and an unknown ``loss_agg_mode``.
    """
    require_2d("log_prob", log_prob)
    require_same_shape(
        "log_prob",
        log_prob,
        old_log_prob=old_log_prob,
        advantages=advantages,
        response_mask=response_mask,
    )
    for name, tensor in (
        ("old_log_prob", old_log_prob),
        ("log_prob", log_prob),
        ("advantages", advantages),
    ):
        require_floating(name, tensor)
    low = require_finite_number("clip_ratio_low", clip_ratio_low, minimum=0.0)
    if low >= 1.0:
        raise ValueError(f"clip_ratio_low must be < 1 (the ratio floor is 1 - it), got {low}")
    high = require_finite_number("clip_ratio_high", clip_ratio_high, minimum=0.0)
    dual = require_finite_number("clip_ratio_c", clip_ratio_c, minimum=1.0, minimum_inclusive=False)

    negative_approx_kl = torch.clamp(
        log_prob - old_log_prob, min=-_LOG_RATIO_BOUND, max=_LOG_RATIO_BOUND
    )
    ratio = torch.exp(negative_approx_kl)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    clipped_max = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * dual
    negative = advantages < 0
    token_losses = torch.where(negative, torch.minimum(dual_bound, clipped_max), clipped_max)
    if is_weights is not None:
        require_same_shape("log_prob", log_prob, is_weights=is_weights)
        token_losses = token_losses * is_weights.detach()
    loss = agg_loss(token_losses, response_mask, loss_agg_mode, global_batch=global_batch)

    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean(torch.gt(clipped, unclipped).float(), response_mask),
            "ppo_kl": masked_mean(-negative_approx_kl, response_mask),
            "pg_clipfrac_lower": masked_mean(
                (torch.gt(clipped_max, dual_bound) & negative).float(), response_mask
            ),
        }
    return loss, {name: float(value.item()) for name, value in metrics.items()}


def entropy_loss(
    entropies: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    global_batch: GlobalBatchInfo | None = None,
) -> torch.Tensor:
    """Aggregated token entropy ``(bs, response_length)`` -> scalar (the term ``entropy_coeff``
    multiplies). Errors as :func:`agg_loss`, plus TypeError for non-float entropies."""
    require_tensor("entropies", entropies)
    require_floating("entropies", entropies)
    return agg_loss(entropies, response_mask, loss_agg_mode, global_batch=global_batch)


def kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kind: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    global_batch: GlobalBatchInfo | None = None,
) -> torch.Tensor:
    """Aggregated KL to the reference policy, all inputs ``(bs, response_length)``.

    Errors as :func:`kl_penalty` (unknown ``kind``) and :func:`agg_loss` (shapes, mode).
    """
    require_2d("log_prob", log_prob)
    per_token = kl_penalty(log_prob, ref_log_prob, kind)
    return agg_loss(per_token, response_mask, loss_agg_mode, global_batch=global_batch)


def actor_loss(
    pg_loss: torch.Tensor,
    *,
    entropy: torch.Tensor | None = None,
    entropy_coeff: float = 0.0,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """``pg_loss - entropy_coeff * entropy + kl_coef * kl`` for scalar loss terms.

    A term left as None contributes nothing. Raises TypeError for a non-tensor ``pg_loss`` and
    ValueError for a non-scalar term, a negative or non-finite coefficient, or a nonzero
    coefficient whose term is missing (a configuration that silently trains without it).
    """
    require_tensor("pg_loss", pg_loss)
    entropy_weight = require_finite_number("entropy_coeff", entropy_coeff, minimum=0.0)
    kl_weight = require_finite_number("kl_coef", kl_coef, minimum=0.0)
    total = pg_loss
    for name, term, weight, sign in (
        ("entropy", entropy, entropy_weight, -1.0),
        ("kl", kl, kl_weight, 1.0),
    ):
        if term is None:
            if weight != 0.0:
                raise ValueError(f"{name} is None but its coefficient is {weight}; pass the term")
            continue
        require_tensor(name, term)
        if term.dim() != 0:
            raise ValueError(f"{name} must be a scalar loss, got shape {tuple(term.shape)}")
        total = total + sign * weight * term
    if total.dim() != 0:
        raise ValueError(f"pg_loss must be a scalar loss, got shape {tuple(pg_loss.shape)}")
    return total
