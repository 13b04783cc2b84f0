"""GRPO and EGPO outcome advantages.

GRPO (as verl 0.9.1 ``compute_grpo_outcome_advantage``): each response's score is the sum of its
token-level rewards; within a group (responses sharing a uid) the advantage is
``(score - mean) / (std + epsilon)`` with the unbiased std, or ``score - mean`` without std
normalisation; a group of one has mean 0 and std 1. The scalar is broadcast over the response
and multiplied by the response mask.

EGPO (Hao et al. 2025, arXiv 2508.05118) adds an entropy bonus from ``H_i``, the mean token
entropy over the chain-of-thought tokens of response ``i`` (see :mod:`workers.trainer.cot`).
Two published forms are registered in :data:`EGPO_VARIANTS`:

- ``clip`` (the reference implementation): ``A + lam * clip(H, -|A|/alpha, |A|/alpha)``
- ``paper`` (arXiv v4, Eq. 5): ``A + min(lam * H, |A|/alpha)``

Both keep the sign of every nonzero advantage and give zero advantages no bonus; a response with
no CoT tokens gets no bonus.

This module needs only torch, so other trainers (verl included) can import it alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from workers.registry import Registry
from workers.trainer.checks import (
    require_2d,
    require_finite_number,
    require_floating,
    require_same_shape,
)
from workers.trainer.cot import cot_mask
from workers.trainer.groups import group_codes, group_mean_std

__all__ = [
    "EGPO_VARIANTS",
    "EntropyBonus",
    "cot_mask",
    "egpo_advantages",
    "grpo_advantages",
    "grpo_scalar_advantages",
    "mean_cot_entropy",
]

EntropyBonus = Callable[..., torch.Tensor]
"""``bonus(advantages (bs,), entropy (bs,), *, lam, alpha) -> bonus (bs,)``."""

EGPO_VARIANTS: Registry[EntropyBonus] = Registry("EGPO variant")

# Entropies are nonnegative; values slightly below zero are rounding in the entropy computation.
_NEGATIVE_ENTROPY_TOLERANCE = 1e-3
_BLOCK_TOKENS = 1 << 20


@EGPO_VARIANTS.register("clip")
def clip_bonus(
    advantages: torch.Tensor, entropy: torch.Tensor, *, lam: float, alpha: float
) -> torch.Tensor:
    """``lam * clip(H, -|A|/alpha, |A|/alpha)``, ``(bs,)``.

    The bonus lies in ``[0, lam*|A|/alpha]`` for ``H >= 0``, so the sign of ``A`` is kept exactly
    when ``lam < alpha``; ValueError otherwise.
    """
    if not lam < alpha:
        raise ValueError(
            f"EGPO variant 'clip' needs lam < alpha so the bonus never flips a negative "
            f"advantage, got lam={lam}, alpha={alpha}"
        )
    bound = advantages.abs() / alpha
    return lam * torch.minimum(torch.maximum(entropy, -bound), bound)


@EGPO_VARIANTS.register("paper")
def paper_bonus(
    advantages: torch.Tensor, entropy: torch.Tensor, *, lam: float, alpha: float
) -> torch.Tensor:
    """``min(lam * H, |A|/alpha)``, ``(bs,)`` (arXiv 2508.05118 v4, Eq. 5).

    The bonus lies in ``[0, |A|/alpha]`` for ``H >= 0``, so the sign of ``A`` is kept when
    ``alpha > 1``; ValueError otherwise.
    """
    if not alpha > 1.0:
        raise ValueError(
            f"EGPO variant 'paper' needs alpha > 1 so the bonus never flips a negative "
            f"advantage, got alpha={alpha}"
        )
    return torch.minimum(lam * entropy, advantages.abs() / alpha)


def _check_rewards(
    token_level_rewards: object, response_mask: object
) -> tuple[torch.Tensor, torch.Tensor]:
    rewards = require_2d("token_level_rewards", token_level_rewards)
    require_floating("token_level_rewards", rewards)
    require_same_shape("token_level_rewards", rewards, response_mask=response_mask)
    assert isinstance(response_mask, torch.Tensor)
    return rewards, response_mask


def grpo_scalar_advantages(
    token_level_rewards: torch.Tensor,
    index: object,
    *,
    norm_adv_by_std: bool = True,
    epsilon: float = 1e-6,
    units: object = None,
) -> torch.Tensor:
    """One GRPO advantage per response, ``(bs,)``, before broadcasting over tokens.

    ``token_level_rewards`` is ``(bs, response_length)``; its row sums are the scores (all
    positions, as verl does). ``index`` holds one group id per response.

    ``units`` (rollout-level statistics): one unit id per response, e.g. the episode id for an
    episode's samples and a unit of its own for each negative sample. A unit's score is the
    mean of its responses' scores; the group mean and std are taken over the units of the
    group (each unit counted once, however many samples it yielded), and every response of a
    unit gets the unit's advantage. With one response per unit this is exactly the
    sample-level result. A unit whose responses lie in different groups raises ValueError.

    Raises TypeError/ValueError for a non-tensor or non-float reward tensor, an ``index`` of the
    wrong length or kind, a negative or non-finite ``epsilon``, and non-finite scores (the row
    numbers are named).
    """
    rewards = require_2d("token_level_rewards", token_level_rewards)
    require_floating("token_level_rewards", rewards)
    eps = require_finite_number("epsilon", epsilon, minimum=0.0)
    if not isinstance(norm_adv_by_std, bool):
        raise TypeError(f"norm_adv_by_std must be a bool, got {norm_adv_by_std!r}")
    codes = group_codes(index, size=rewards.shape[0], device=rewards.device)
    scores = rewards.detach().sum(dim=-1)
    if not bool(torch.isfinite(scores).all()):
        rows = torch.nonzero(~torch.isfinite(scores)).flatten()[:10].tolist()
        raise ValueError(f"token_level_rewards has non-finite row sums at rows {rows}")
    if scores.numel() == 0:
        return scores
    if units is not None:
        return _unit_advantages(scores, codes, group_codes(units, size=scores.shape[0],
                                                           device=scores.device),
                                norm_adv_by_std=norm_adv_by_std, eps=eps)
    means, stds = group_mean_std(scores, codes)
    # In place on the fresh per-response tensors: the same float operations, in the same order,
    # as (scores - means) / (stds + eps).
    centred = means.neg_().add_(scores)
    if norm_adv_by_std:
        return centred.div_(stds.add_(eps))
    return centred


def _unit_advantages(scores: torch.Tensor, codes: torch.Tensor, unit_codes: torch.Tensor, *,
                     norm_adv_by_std: bool, eps: float) -> torch.Tensor:
    """GRPO over units (see :func:`grpo_scalar_advantages`), gathered back to the responses."""
    num_units = int(unit_codes.max()) + 1
    counts = torch.bincount(unit_codes, minlength=num_units).to(torch.float64)
    unit_scores = torch.zeros(num_units, dtype=torch.float64, device=scores.device).index_add_(
        0, unit_codes, scores.to(torch.float64)).div_(counts).to(scores.dtype)
    unit_groups = torch.zeros(num_units, dtype=torch.long, device=scores.device)
    unit_groups.index_copy_(0, unit_codes, codes)
    if not bool(torch.equal(unit_groups.index_select(0, unit_codes), codes)):
        raise ValueError("units: every response of a unit must share one group id")
    means, stds = group_mean_std(unit_scores, unit_groups)
    centred = means.neg_().add_(unit_scores)
    if norm_adv_by_std:
        centred = centred.div_(stds.add_(eps))
    return centred.index_select(0, unit_codes)


def _broadcast(
    scalars: torch.Tensor, mask: torch.Tensor, out: torch.Tensor | None
) -> torch.Tensor:
    """``scalars[:, None] * mask``, written into ``out`` when given. Raises TypeError when
    ``out`` is not a tensor or has another dtype than the product, ValueError when its shape or
    device differs from the mask's."""
    if out is None:
        return scalars.unsqueeze(-1) * mask
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    dtype = torch.promote_types(scalars.dtype, mask.dtype)
    if out.shape != mask.shape:
        raise ValueError(
            f"out has shape {tuple(out.shape)} but response_mask has shape "
            f"{tuple(mask.shape)}; they must match"
        )
    if out.dtype != dtype:
        raise TypeError(f"out must have dtype {dtype} (the advantages'), got {out.dtype}")
    if out.device != mask.device:
        raise ValueError(f"out is on {out.device} but response_mask is on {mask.device}")
    return torch.mul(scalars.unsqueeze(-1), mask, out=out)


def grpo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: object,
    *,
    norm_adv_by_std: bool = True,
    epsilon: float = 1e-6,
    out: torch.Tensor | None = None,
    units: object = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantages ``(bs, response_length)``; returns equal the advantages.

    ``token_level_rewards`` and ``response_mask`` are ``(bs, response_length)``; ``index`` is a
    sequence (list, numpy array, tensor) of ``bs`` hashable group ids. Identical to verl 0.9.1's
    ``compute_grpo_outcome_advantage`` (with ``norm_adv_by_std`` for its
    ``norm_adv_by_std_in_grpo``), vectorised. No gradient flows through the result.

    ``out``: a tensor of the mask's shape and device and the advantages' dtype to write them
    into (and return), instead of a new one. A training loop that passes the same buffer each
    step skips allocating, and page-faulting in, a fresh ``(bs, response_length)`` tensor.
    ``units``: rollout-level statistics, as in :func:`grpo_scalar_advantages`.

    Raises TypeError/ValueError (naming the argument) for shape mismatches, tensors that are not
    2-D, non-float rewards, an ``index`` of the wrong length or with unhashable or NaN ids, a bad
    ``epsilon``, non-finite reward sums, and an ``out`` of another shape, dtype or device. When
    it raises, ``out`` is left as it was.
    """
    rewards, mask = _check_rewards(token_level_rewards, response_mask)
    with torch.no_grad():
        scalars = grpo_scalar_advantages(
            rewards, index, norm_adv_by_std=norm_adv_by_std, epsilon=epsilon, units=units
        )
        advantages = _broadcast(scalars, mask, out)
    return advantages, advantages


def mean_cot_entropy(
    entropies: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean entropy over the CoT tokens of each response and whether it has any, both ``(bs,)``.

    ``entropies`` is ``(bs, response_length)`` float, ``mask`` the boolean output of
    :func:`cot_mask`. Rows with no CoT tokens get entropy 0 and ``False``. Entropies on CoT
    tokens must be finite and nonnegative (tiny negative rounding is clamped to 0); ValueError
    naming the rows otherwise. The mean is taken in float32 (or float64 for float64 input).
    """
    work_dtype = torch.float64 if entropies.dtype == torch.float64 else torch.float32
    bs, length = entropies.shape
    sums = torch.zeros(bs, dtype=work_dtype, device=entropies.device)
    counts = torch.zeros(bs, dtype=work_dtype, device=entropies.device)
    lowest = torch.zeros(bs, dtype=work_dtype, device=entropies.device)
    # Row blocks of about a million tokens keep the float temporaries small (no second
    # (bs, response_length) float tensor; on CPU small blocks also reuse freed memory).
    rows_per_block = max(1, _BLOCK_TOKENS // max(length, 1))
    for start in range(0, bs if length else 0, rows_per_block):
        block = slice(start, start + rows_per_block)
        values = torch.where(mask[block], entropies[block].detach().to(work_dtype), 0.0)
        sums[block] = values.sum(dim=1)
        lowest[block] = values.amin(dim=1)
        counts[block] = mask[block].sum(dim=1, dtype=work_dtype)
    # A NaN or infinity on a CoT token makes its row sum non-finite; other values are zeroed.
    bad = ~torch.isfinite(sums) | (lowest < -_NEGATIVE_ENTROPY_TOLERANCE)
    if bool(bad.any()):
        rows = torch.nonzero(bad).flatten()[:10].tolist()
        raise ValueError(
            f"entropies must be finite and nonnegative on CoT tokens; rows {rows} are not"
        )
    has_cot = counts > 0
    mean = sums / counts.clamp(min=1)
    return mean.clamp(min=0.0), has_cot


def egpo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: object,
    entropies: torch.Tensor,
    responses: torch.Tensor,
    *,
    cot_start_id: int,
    cot_end_id: int,
    lam: float = 0.4,
    alpha: float = 2.0,
    variant: str = "clip",
    norm_adv_by_std: bool = True,
    epsilon: float = 1e-6,
    out: torch.Tensor | None = None,
    units: object = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """EGPO advantages ``(bs, response_length)``: GRPO plus a bounded CoT-entropy bonus.

    ``token_level_rewards``, ``response_mask``, ``entropies`` (token entropies of the current
    policy) and ``responses`` (token ids) are ``(bs, response_length)``; ``index`` holds ``bs``
    group ids. ``variant`` names an entry of :data:`EGPO_VARIANTS` (``clip`` or ``paper``). The
    scalar ``A_i + bonus_i`` is broadcast over the response and multiplied by the mask; returns
    equal the advantages. No gradient flows through the result. ``out`` and ``units``
    (rollout-level GRPO statistics; the bonus stays each response's own) as in
    :func:`grpo_advantages`.

    Raises TypeError/ValueError (naming the argument) for everything :func:`grpo_advantages` and
    :func:`workers.trainer.cot.cot_mask` refuse, an unknown ``variant`` (the known ones are
    listed), negative or non-finite ``lam``, non-positive ``alpha``, parameters under which the
    variant could flip an advantage's sign, and negative or non-finite CoT entropies.
    """
    rewards, mask = _check_rewards(token_level_rewards, response_mask)
    require_same_shape("token_level_rewards", rewards, entropies=entropies, responses=responses)
    require_floating("entropies", entropies)
    bonus_fn = EGPO_VARIANTS.get(variant)
    lam_value = require_finite_number("lam", lam, minimum=0.0)
    alpha_value = require_finite_number("alpha", alpha, minimum=0.0, minimum_inclusive=False)
    thought = cot_mask(responses, mask, cot_start_id=cot_start_id, cot_end_id=cot_end_id)
    with torch.no_grad():
        scalars = grpo_scalar_advantages(
            rewards, index, norm_adv_by_std=norm_adv_by_std, epsilon=epsilon, units=units
        )
        entropy, has_cot = mean_cot_entropy(entropies, thought)
        entropy = entropy.to(scalars.dtype)
        bonus = bonus_fn(scalars, entropy, lam=lam_value, alpha=alpha_value)
        bonus = torch.where(has_cot & (scalars != 0), bonus, torch.zeros_like(bonus))
        combined = scalars + bonus
        # |bonus| < |A| keeps the sign exactly, but for a subnormal A the sum can round to 0:
        # keep A there so the sign guarantee also holds in floating point.
        combined = torch.where((combined == 0) & (scalars != 0), scalars, combined)
        advantages = _broadcast(combined, mask, out)
    return advantages, advantages
