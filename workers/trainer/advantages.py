"""Advantage estimators by name, and how a run's configuration picks one.

Both estimators share one signature, so the training step resolves the configured name once
and never branches on it: ``estimator(token_level_rewards, response_mask, index, *,
entropies, responses, settings, units=None) -> advantages (bs, response_length)``; ``units``
(one id per response) switches to rollout-level group statistics
(:func:`workers.trainer.egpo.grpo_scalar_advantages`).
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
    "choose_estimator",
    "think_token_ids",
]

#: The chain-of-thought markers EGPO reads from the tokenizer.
THINK_TOKENS = ("<think>", "</think>")


@dataclass(frozen=True, kw_only=True)
class AdvantageSettings:
    """What the estimators need beyond the tensors: GRPO's std normalisation and EGPO's
    λ, α, variant and CoT marker ids (unused by GRPO; None only when GRPO is used)."""

    norm_adv_by_std: bool = True
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
