"""From a padded batch to an updated policy: old log-probs, correction, advantages, PPO.

What :meth:`workers.trainer.loop.Trainer.step` does between the lease and the checkpoint, as
one function so that the benchmark measures the same code.

The old log-probs (the policy's before the update) feed the PPO ratio, the off-policy
correction (against the rollout log-probs) and, through the token entropies, EGPO's bonus.
verl recomputes them in a separate no-grad forward over the batch. When the update runs one
epoch over one mini-batch, no optimizer step happens before every micro-batch has been scored
once, so the update's own forward computes exactly those log-probs: the scoring forward is
skipped and each micro-batch's advantages and IS weights are computed from its detached
log-probs and entropies just before its loss (:func:`ppo_update`'s ``first_pass``). That is
exact when everything the loss needs of a row depends on that row's log-probs and entropies
alone and the loss normalisation does not depend on them:

- GRPO advantages need no entropies; EGPO's bonus is each response's own mean CoT entropy,
  bounded by its own GRPO advantage (the group statistics come from rewards only), so both
  estimators are row-local;
- token- and sequence-level IS weights, truncated or IcePop, are row-local;
- decoupled rejection changes the response mask, and with it the token (or row) counts every
  micro-batch's loss is divided by, before the first micro-batch's loss, and batch-normalised
  IS weights need the whole batch's mean: such a run keeps the scoring pass
  (:func:`workers.trainer.correction.needs_whole_batch`), as do several epochs or
  mini-batches, and ``TrainerConfig.separate_scoring``. Bypass mode computes its weights and
  rejection inside each micro-batch's loss (as verl does), so it takes the single pass too.

The reference model's log-probs (KL term) are computed before the update either way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from workers.trainer.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageSettings,
    batch_advantages,
)
from workers.trainer.batch import TrainingBatch, token_level_rewards
from workers.trainer.config import TrainerConfig
from workers.trainer.correction import (
    Bypass,
    Correction,
    CorrectionConfig,
    compute_correction,
    has_rollout_log_probs,
    needs_whole_batch,
)
from workers.trainer.ppo import PPOStats, Sharding, ppo_update, score_batch

__all__ = ["ROW_LOCAL_ESTIMATORS", "BatchUpdate", "applied", "bypass_of", "single_pass",
           "update_batch"]

#: Estimators whose advantage for a row depends on no other row's entropies.
ROW_LOCAL_ESTIMATORS = frozenset({"grpo", "egpo"})


@dataclass(frozen=True)
class BatchUpdate:
    """What :func:`update_batch` computed: the update's statistics, the old log-probs and
    entropies ``(bs, response_length)`` (zeros on padding), the advantages, the correction
    (weights, mask after rejection, ``correction_*`` metrics; in bypass mode the statistics of
    the batch before the update, its weights and mask unused) and whether the scoring forward
    was skipped."""

    stats: PPOStats
    old_log_probs: torch.Tensor
    entropies: torch.Tensor
    advantages: torch.Tensor
    correction: Correction
    single_pass: bool


def single_pass(config: TrainerConfig, *, samples: int, estimator: str,
                correction: CorrectionConfig) -> bool:
    """Whether the update's forward can give the old log-probs (module docstring)."""
    mini = config.mini_batch_size or samples
    return (not config.separate_scoring and config.ppo_epochs == 1 and mini >= samples
            and estimator in ROW_LOCAL_ESTIMATORS and not needs_whole_batch(correction))


def bypass_of(batch: TrainingBatch, correction: CorrectionConfig,
              corrected_rows: torch.Tensor | None = None) -> Bypass | None:
    """The :class:`~workers.trainer.correction.Bypass` of ``batch`` in bypass mode, else
    None."""
    if correction.mode != "bypass":
        return None
    if corrected_rows is None:
        corrected_rows = has_rollout_log_probs(batch.rollout_log_probs, batch.response_mask)
    return Bypass(correction, batch.rollout_log_probs, corrected_rows)


def applied(corrected: Correction, correction: CorrectionConfig,
            response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The IS weights and response mask the update applies before its loss: the
    correction's in decoupled mode; ones and ``response_mask`` in bypass mode (its loss
    corrects)."""
    if correction.mode == "bypass":
        return torch.ones_like(corrected.weights), response_mask
    return corrected.weights, corrected.response_mask


def update_batch(model: Any, batch: TrainingBatch, *, optimizer: torch.optim.Optimizer,
                 config: TrainerConfig, estimator: str, advantage_settings: AdvantageSettings,
                 correction: CorrectionConfig, reference: Any | None = None,
                 units: Sequence[str] | None = None,
                 unit_weights: torch.Tensor | None = None,
                 between_steps: Callable[[], None] | None = None,
                 sharding: Sharding | None = None,
                 score: Callable[[Any, TrainingBatch], tuple[torch.Tensor, torch.Tensor]]
                 | None = None,
                 scored: Any | None = None) -> BatchUpdate:
    """Score (or not, module docstring), correct, compute advantages and run the PPO update
    of ``batch`` on ``model``. ``units`` are the rollout-level units of the rows (None: every
    sample counts alone) and ``unit_weights`` ``(bs,)`` their loss weights; ``reference`` is
    the frozen model of the KL term (needed when ``config.kl_coef > 0``).

    Spread over processes (the trainer's distribution strategy): ``sharding`` gives this
    process its rows of each mini-batch (:func:`ppo_update`), ``score(what, batch)`` computes
    whole-batch log-probs and entropies of ``scored`` (the policy) and of ``reference``
    (default: :func:`score_batch` of the model itself), and the scoring pass is always run.

    Raises KeyError for an unknown estimator (naming the known ones), and the errors of
    :func:`score_batch`, :func:`compute_correction`, the estimator and :func:`ppo_update`."""
    advantage_fn = ADVANTAGE_ESTIMATORS.get(estimator)

    def scoring(what: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if score is not None:
            return score(what, batch)
        return score_batch(what, batch, config=config)

    ref_log_probs = scoring(reference)[0] if reference is not None else None
    rewards = token_level_rewards(batch.rewards, batch.response_mask,
                                  response_lengths=batch.response_lengths)

    def advantages_of(entropies: torch.Tensor) -> torch.Tensor:
        return batch_advantages(advantage_fn, rewards, batch.response_mask, batch.group_ids,
                                batch.is_negative, entropies=entropies,
                                responses=batch.responses, settings=advantage_settings,
                                units=units)

    def weighted(weights: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
        if unit_weights is None:
            return weights
        scale = unit_weights if rows is None else unit_weights[rows]
        return weights * scale.to(weights.device).unsqueeze(1)

    if sharding is not None or not single_pass(config, samples=len(batch), estimator=estimator,
                                               correction=correction):
        old_log_probs, entropies = scoring(scored if scored is not None else model)
        corrected = compute_correction(old_log_probs, batch.rollout_log_probs,
                                       batch.response_mask, correction)
        weights, response_mask = applied(corrected, correction, batch.response_mask)
        advantages = advantages_of(entropies)
        stats = ppo_update(model, batch, optimizer=optimizer, old_log_probs=old_log_probs,
                           advantages=advantages, config=config, ref_log_probs=ref_log_probs,
                           between_steps=between_steps, is_weights=weighted(weights),
                           response_mask=response_mask, bypass=bypass_of(batch, correction),
                           sharding=sharding)
        return BatchUpdate(stats, old_log_probs, entropies, advantages, corrected, False)

    mask = batch.response_mask.to(torch.float32)
    corrected_rows = has_rollout_log_probs(batch.rollout_log_probs, mask)
    seen = torch.zeros(tuple(batch.responses.shape), dtype=torch.float32,
                       device=batch.responses.device)
    # GRPO's advantages need no entropies: computed once. EGPO's are recomputed per
    # micro-batch from the entropies seen so far; a row's own are in by then.
    fixed = advantages_of(seen) if estimator == "grpo" else None
    advantages = torch.zeros_like(seen)

    def first_pass(rows: list[int], old: torch.Tensor, entropies: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        width = old.shape[1]
        index = torch.tensor(rows, device=seen.device)
        seen[index, :width] = entropies
        full = fixed if fixed is not None else advantages_of(seen)
        advantages[index] = full[index]
        part = compute_correction(old, batch.rollout_log_probs[rows, :width], mask[rows, :width],
                                  correction, corrected_rows=corrected_rows[rows])
        weights, _ = applied(part, correction, mask[rows, :width])
        return full[rows, :width], weighted(weights, rows)

    stats = ppo_update(model, batch, optimizer=optimizer, old_log_probs=None, advantages=None,
                       config=config, ref_log_probs=ref_log_probs, between_steps=between_steps,
                       first_pass=first_pass,
                       bypass=bypass_of(batch, correction, corrected_rows))
    assert stats.old_log_probs is not None and stats.entropies is not None
    # The whole batch's correction once more, for its statistics (its weights are those the
    # micro-batches used: every quantity is row-local).
    corrected = compute_correction(stats.old_log_probs, batch.rollout_log_probs,
                                   batch.response_mask, correction,
                                   corrected_rows=corrected_rows)
    return BatchUpdate(stats, stats.old_log_probs, stats.entropies, advantages, corrected, True)
