"""Advantage estimators by name, and how a run's configuration picks one.

Both estimators share one signature, so the training step resolves the configured name once
and never branches on it: ``estimator(token_level_rewards, response_mask, index, *,
entropies, responses, settings, units=None) -> advantages (bs, response_length)``; ``units``
(one id per response) switches to rollout-level group statistics
(:func:`workers.trainer.egpo.grpo_scalar_advantages`). :func:`batch_advantages` applies the
run's rule for negative samples (``NegativeConfig.baseline``) around the estimator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from store.events import EGPO_ALPHA, EGPO_LAM
from workers.registry import Registry
from workers.trainer.egpo import egpo_advantages, grpo_advantages

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageSettings",
    "THINK_TOKENS",
    "batch_advantages",
    "choose_estimator",
    "think_token_ids",
]

#: The chain-of-thought markers EGPO reads from the tokenizer.
THINK_TOKENS = ("<think>", "</think>")


@dataclass(frozen=True, kw_only=True)
class AdvantageSettings:
    """What the estimators need beyond the tensors: GRPO's std normalisation and EGPO's
    λ, α, variant and CoT marker ids (unused by GRPO; None only when GRPO is used), and
    whether negative samples join their group's statistics (the run's
    ``NegativeConfig.baseline``: ``group``) or take their reward as their advantage
    (``episodes``; read by :func:`batch_advantages`)."""

    norm_adv_by_std: bool = True
    negatives_in_baseline: bool = True
    lam: float = EGPO_LAM
    alpha: float = EGPO_ALPHA
    variant: str = "clip"
    cot_start_id: int | None = None
    cot_end_id: int | None = None


AdvantageFn = Callable[..., torch.Tensor]
ADVANTAGE_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator")


@ADVANTAGE_ESTIMATORS.register("grpo")
def _grpo(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
          index: Sequence[str], *, entropies: torch.Tensor, responses: torch.Tensor,
          settings: AdvantageSettings, units: Sequence[str] | None = None) -> torch.Tensor:
    advantages, _ = grpo_advantages(token_level_rewards, response_mask, index,
                                    norm_adv_by_std=settings.norm_adv_by_std, units=units)
    return advantages


@ADVANTAGE_ESTIMATORS.register("egpo")
def _egpo(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
          index: Sequence[str], *, entropies: torch.Tensor, responses: torch.Tensor,
          settings: AdvantageSettings, units: Sequence[str] | None = None) -> torch.Tensor:
    if settings.cot_start_id is None or settings.cot_end_id is None:
        raise ValueError("EGPO needs cot_start_id and cot_end_id (the <think> and </think> "
                         "token ids); the tokenizer has none and none were configured")
    advantages, _ = egpo_advantages(
        token_level_rewards, response_mask, index, entropies, responses,
        cot_start_id=settings.cot_start_id, cot_end_id=settings.cot_end_id,
        lam=settings.lam, alpha=settings.alpha, variant=settings.variant,
        norm_adv_by_std=settings.norm_adv_by_std, units=units)
    return advantages


def choose_estimator(configured: str | None, *, egpo_lam: float) -> str:
    """The estimator name: ``configured`` when given (checked against the registry), else
    "egpo" when the run's EGPO λ is above 0 and "grpo" when it is 0 (EGPO with λ = 0 is GRPO).
    Raises ValueError for an unknown name."""
    if configured is not None:
        ADVANTAGE_ESTIMATORS.get(configured)
        return configured
    return "egpo" if egpo_lam > 0 else "grpo"


def think_token_ids(tokenizer: Any, *, start: int | None = None, end: int | None = None
                    ) -> tuple[int | None, int | None]:
    """The ``<think>``/``</think>`` ids: ``start``/``end`` when given, else the tokenizer's
    (None for a marker the tokenizer does not have as a single token)."""

    def lookup(token: str) -> int | None:
        ids = tokenizer.convert_tokens_to_ids([token])
        value = ids[0] if ids else None
        unknown = getattr(tokenizer, "unk_token_id", None)
        if value is None or (unknown is not None and value == unknown):
            return None
        return int(value)

    return (start if start is not None else lookup(THINK_TOKENS[0]),
            end if end is not None else lookup(THINK_TOKENS[1]))


def batch_advantages(estimator: AdvantageFn, token_level_rewards: torch.Tensor,
                     response_mask: torch.Tensor, index: Sequence[str],
                     is_negative: torch.Tensor, *, entropies: torch.Tensor,
                     responses: torch.Tensor, settings: AdvantageSettings,
                     units: Sequence[str] | None = None) -> torch.Tensor:
    """``estimator``'s advantages ``(bs, response_length)`` under the run's rule for negative
    samples. With ``settings.negatives_in_baseline`` (``NegativeConfig.baseline == "group"``)
    every row enters the estimator, negatives with their reward. Otherwise the estimator sees
    the positive rows alone (a group's mean and spread are its episodes'), and each negative
    row's advantage is its own reward (its row sum, the run's ``negative_reward``) on every
    token of its mask: a group whose episodes all failed gives them 0 and trains only its
    negatives, instead of lifting its failed episodes above the negative's reward.

    Raises ValueError when ``is_negative`` is not one bool per row, and the estimator's
    errors."""
    if settings.negatives_in_baseline or not bool(is_negative.any()):
        return estimator(token_level_rewards, response_mask, index, entropies=entropies,
                         responses=responses, settings=settings, units=units)
    rows = token_level_rewards.shape[0]
    if is_negative.dtype != torch.bool or tuple(is_negative.shape) != (rows,):
        raise ValueError(f"is_negative must be a bool tensor of shape ({rows},), got "
                         f"{is_negative.dtype} {tuple(is_negative.shape)}")
    negative = is_negative.to(token_level_rewards.device)
    mask = response_mask.to(token_level_rewards.dtype)
    out = token_level_rewards.sum(dim=1, keepdim=True) * mask
    kept = torch.nonzero(~negative).flatten()
    if kept.numel():
        picked = kept.tolist()
        out[kept] = estimator(
            token_level_rewards[kept], response_mask[kept], [index[i] for i in picked],
            entropies=entropies[kept], responses=responses[kept], settings=settings,
            units=None if units is None else [units[i] for i in picked]).to(out.dtype)
    return out
