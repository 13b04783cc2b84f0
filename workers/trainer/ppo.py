"""The PPO update of one leased batch: mini-batch epochs with gradient accumulation.

Follows verl 0.9.1's actor: the batch is split into mini-batches (one optimizer step each) for
``ppo_epochs`` epochs; a mini-batch is processed ``micro_batch_size`` rows at a time and each
micro-batch's loss is scaled by the mini-batch's token (or sequence) count
(:class:`~workers.trainer.aggregation.GlobalBatchInfo`), so the accumulated gradient equals
that of the whole mini-batch at once. Gradients are clipped by global norm; a step whose
gradient norm is not finite is skipped (and counted).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from workers.trainer.aggregation import GlobalBatchInfo
from workers.trainer.batch import TrainingBatch
from workers.trainer.config import TrainerConfig
from workers.trainer.correction import Bypass, bypass_policy_loss
from workers.trainer.losses import (
    actor_loss,
    entropy_loss,
    kl_loss,
    masked_mean,
    ppo_policy_loss,
)
from workers.trainer.optim import clipped_step
from workers.trainer.policy import response_log_probs

__all__ = ["FirstPass", "PPOStats", "Sharding", "micro_batches", "ppo_update", "score_batch"]

FirstPass = Callable[[list[int], torch.Tensor, torch.Tensor],
                     tuple[torch.Tensor, torch.Tensor | None]]
"""``first_pass(rows, log_probs, entropies) -> (advantages, is_weights)``: given a
micro-batch's rows and their detached log-probs and entropies ``(len(rows), width)`` (zeros on
padding) from the update's own forward, the advantages and IS weights (None: 1) of those rows,
same shape. See :func:`ppo_update`."""


class Sharding(Protocol):
    """How :func:`ppo_update` runs as one of several data-parallel ranks
    (:mod:`workers.trainer.distributed`): every rank holds the whole batch, takes its share of
    each mini-batch's rows from ``micro_batches`` (as many micro-batches on every rank, so the
    ranks' collectives pair up) and scores them through ``log_probs``; losses are normalised
    by the whole mini-batch's counts times ``world_size``, and the ranks' gradients averaged."""

    world_size: int

    def micro_batches(self, batch: TrainingBatch, rows: list[int], *, size: int
                      ) -> Iterable[tuple[list[int], TrainingBatch]]: ...

    def log_probs(self, model: Any, batch: TrainingBatch, *, chunk_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor]: ...


def micro_batches(batch: TrainingBatch, rows: list[int], *, size: int
                  ) -> Iterator[tuple[list[int], TrainingBatch]]:
    """``(rows, trimmed sub-batch)`` for consecutive slices of ``rows`` of at most ``size``;
    each sub-batch is cut to its own longest sequence and response. Raises ValueError for
    ``size < 1`` and IndexError for a row outside the batch."""
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size!r}")
    for start in range(0, len(rows), size):
        part = rows[start:start + size]
        yield part, trim(batch.select(part))


def trim(batch: TrainingBatch) -> TrainingBatch:
    """``batch`` without the padding columns no row of it needs (positions clamped into the
    shorter sequences). A batch is never empty, so this cannot fail."""
    seq = max(int(batch.attention_mask.sum(dim=1).max().item()), 1)
    response_length = max(int(batch.response_lengths.max().item()), 1)
    return TrainingBatch(
        input_ids=batch.input_ids[:, :seq],
        attention_mask=batch.attention_mask[:, :seq],
        responses=batch.responses[:, :response_length],
        response_positions=batch.response_positions[:, :response_length].clamp(max=seq - 1),
        response_mask=batch.response_mask[:, :response_length],
        response_lengths=batch.response_lengths,
        rollout_log_probs=batch.rollout_log_probs[:, :response_length],
        temperatures=batch.temperatures,
        rewards=batch.rewards,
        is_negative=batch.is_negative,
        group_ids=batch.group_ids,
        sample_ids=batch.sample_ids,
        policy_versions=batch.policy_versions,
        episode_ids=batch.episode_ids,
    )


@torch.no_grad()
def score_batch(model: torch.nn.Module, batch: TrainingBatch, *, config: TrainerConfig
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies ``(bs, response_length)`` of the whole batch without
    gradients, computed ``micro_batch_size`` rows at a time (zeros on padding). Raises the
    errors of :func:`workers.trainer.policy.response_log_probs`."""
    shape = tuple(batch.responses.shape)
    device = batch.responses.device
    log_probs = torch.zeros(shape, dtype=torch.float32, device=device)
    entropies = torch.zeros(shape, dtype=torch.float32, device=device)
    for rows, part in micro_batches(batch, list(range(len(batch))),
                                     size=config.micro_batch_size):
        lp, ent = response_log_probs(model, part, chunk_size=config.logit_chunk_size)
        width = lp.shape[1]
        index = torch.tensor(rows, device=device)
        log_probs[index, :width] = lp * part.response_mask
        entropies[index, :width] = ent * part.response_mask
    return log_probs, entropies


@dataclass
class PPOStats:
    """What the update did: token-weighted means of the per-token metrics (clip fractions,
    approximate KL, entropy), the loss terms averaged over optimizer steps (each step's loss is
    the sum of its micro-batches' scaled losses), the mean gradient norm of the applied steps,
    and the step counts."""

    optimizer_steps: int = 0
    #: With ``first_pass``: the log-probs and entropies ``(bs, response_length)`` of the
    #: update's forward (the old policy's, taken before any optimizer step; zeros on padding).
    old_log_probs: torch.Tensor | None = None
    entropies: torch.Tensor | None = None
    skipped_steps: int = 0
    grad_norm_sum: float = 0.0
    tokens: float = 0.0
    token_sums: dict[str, float] = field(default_factory=dict)
    loss_sums: dict[str, float] = field(default_factory=dict)

    def add_tokens(self, values: dict[str, float], tokens: float) -> None:
        """Add per-token means of a micro-batch of ``tokens`` trainable tokens."""
        for name, value in values.items():
            self.token_sums[name] = self.token_sums.get(name, 0.0) + value * tokens
        self.tokens += tokens

    def add_losses(self, values: dict[str, float]) -> None:
        """Add a micro-batch's scaled loss terms."""
        for name, value in values.items():
            self.loss_sums[name] = self.loss_sums.get(name, 0.0) + value

    def metrics(self) -> dict[str, float]:
        """The statistics as one flat dict of floats."""
        out = {name: total / self.tokens for name, total in self.token_sums.items()
               } if self.tokens else {}
        steps = max(self.optimizer_steps, 1)
        out.update({name: total / steps for name, total in self.loss_sums.items()})
        applied = self.optimizer_steps - self.skipped_steps
        out["grad_norm"] = self.grad_norm_sum / applied if applied else 0.0
        out["optimizer_steps"] = float(self.optimizer_steps)
        out["skipped_steps"] = float(self.skipped_steps)
        return out


def ppo_update(
    model: torch.nn.Module,
    batch: TrainingBatch,
    *,
    optimizer: torch.optim.Optimizer,
    old_log_probs: torch.Tensor | None,
    advantages: torch.Tensor | None,
    config: TrainerConfig,
    ref_log_probs: torch.Tensor | None = None,
    between_steps: Callable[[], None] | None = None,
    is_weights: torch.Tensor | None = None,
    response_mask: torch.Tensor | None = None,
    sharding: Sharding | None = None,
    first_pass: FirstPass | None = None,
    bypass: Bypass | None = None,
) -> PPOStats:
    """Run the PPO epochs over ``batch`` and return the statistics.

    ``old_log_probs``, ``advantages`` and ``ref_log_probs`` (needed when ``config.kl_coef >
    0``) are ``(bs, response_length)`` on the batch's device. ``between_steps`` runs after each
    optimizer step (the training step renews its lease there). ``is_weights`` (off-policy
correction weights) multiply the token losses and ``response_mask`` replaces the batch's mask
(tokens rejected by the correction), both ``(bs, response_length)``. ``sharding`` (default: one
process) makes this one rank of a data-parallel update (:class:`Sharding`). ``bypass`` (the
run's bypass-mode correction) makes the rollout log-probs the loss's old policy, where a row has
them, and each micro-batch's loss :func:`workers.trainer.correction.bypass_policy_loss`.

    Single pass: with ``old_log_probs=None`` and ``advantages=None``, ``first_pass`` gives each
    micro-batch's advantages and IS weights from the detached log-probs and entropies of the
    update's own forward, which are the old log-probs: with one epoch over one mini-batch no
    optimizer step has happened yet when each micro-batch is scored, so this saves the separate
    no-grad scoring forward and trains exactly as if it had run (the ratio is 1). Those
    log-probs and entropies come back in ``PPOStats.old_log_probs``/``entropies``.

    Raises ValueError when ``kl_coef > 0`` and no reference log-probs are given, when
    ``old_log_probs`` and ``advantages`` are not both given or both None with ``first_pass``,
    when the single pass is asked for with more than one epoch or mini-batch (the old
    log-probs would no longer be those of the forward), and the loss functions' errors.
    """
    if config.kl_coef > 0 and ref_log_probs is None:
        raise ValueError("kl_coef > 0 needs ref_log_probs from a reference model")
    params = [p for p in model.parameters() if p.requires_grad]
    n = len(batch)
    mini = config.mini_batch_size or n
    stats = PPOStats()
    single = first_pass is not None
    if single != (old_log_probs is None) or single != (advantages is None):
        raise ValueError("give old_log_probs and advantages, or first_pass and neither of them")
    if single:
        if config.ppo_epochs != 1 or mini < n:
            raise ValueError(f"first_pass needs one epoch over one mini-batch, got ppo_epochs="
                             f"{config.ppo_epochs} and mini_batch_size={mini} for {n} samples")
        stats.old_log_probs = torch.zeros(tuple(batch.responses.shape), dtype=torch.float32,
                                          device=batch.responses.device)
        stats.entropies = torch.zeros_like(stats.old_log_probs)
    if response_mask is not None:
        batch = dataclasses.replace(batch, response_mask=response_mask.to(batch.response_mask))
    model.eval()  # no dropout: the recomputed old log-probs are those of this same function
    for _ in range(config.ppo_epochs):
        for start in range(0, n, mini):
            rows = list(range(start, min(start + mini, n)))
            mask = batch.response_mask[rows]
            info = GlobalBatchInfo(
                dp_size=sharding.world_size if sharding is not None else 1,
                batch_num_tokens=max(int(mask.sum().item()), 1),
                global_batch_size=max(int((mask.sum(dim=1) > 0).sum().item()), 1),
                loss_scale_factor=float(batch.responses.shape[1]),
            )
            optimizer.zero_grad(set_to_none=True)
            parts = (micro_batches(batch, rows, size=config.micro_batch_size) if sharding is None
                     else sharding.micro_batches(batch, rows, size=config.micro_batch_size))
            for part_rows, part in parts:
                width = part.responses.shape[1]
                log_prob, entropy = (response_log_probs if sharding is None
                                     else sharding.log_probs)(
                    model, part, chunk_size=config.logit_chunk_size)
                weights = is_weights[part_rows, :width] if is_weights is not None else None
                if first_pass is not None:
                    assert stats.old_log_probs is not None and stats.entropies is not None
                    # As score_batch stores them: zeros on padding.
                    old = log_prob.detach() * part.response_mask
                    scored_entropy = entropy.detach() * part.response_mask
                    index = torch.tensor(part_rows, device=old.device)
                    stats.old_log_probs[index, :width] = old
                    stats.entropies[index, :width] = scored_entropy
                    adv, first_weights = first_pass(part_rows, old, scored_entropy)
                    if first_weights is not None:
                        weights = first_weights if weights is None else weights * first_weights
                else:
                    assert old_log_probs is not None and advantages is not None
                    old = old_log_probs[part_rows, :width]
                    adv = advantages[part_rows, :width]
                clip: dict[str, Any] = {"clip_ratio_low": config.clip_ratio_low,
                        "clip_ratio_high": config.clip_ratio_high,
                        "clip_ratio_c": config.clip_ratio_c,
                        "loss_agg_mode": config.loss_agg_mode, "global_batch": info}
                if bypass is not None:
                    pg_loss, pg_metrics = bypass_policy_loss(
                        bypass.old_log_probs(part_rows, old), log_prob, adv, part.response_mask,
                        bypass.settings, loss_weights=weights, **clip,
                        corrected_rows=bypass.corrected_rows.to(old.device)[
                            torch.tensor(part_rows, device=old.device)])
                else:
                    pg_loss, pg_metrics = ppo_policy_loss(
                        old, log_prob, adv, part.response_mask, is_weights=weights, **clip)
                ent_term = None
                if config.entropy_coeff > 0:
                    ent_term = entropy_loss(entropy, part.response_mask,
                                            loss_agg_mode=config.loss_agg_mode, global_batch=info)
                kl_term = None
                if ref_log_probs is not None and config.kl_coef > 0:
                    kl_term = kl_loss(log_prob, ref_log_probs[part_rows, :width],
                                      part.response_mask, kind=config.kl_kind,
                                      loss_agg_mode=config.loss_agg_mode, global_batch=info)
                loss = actor_loss(pg_loss, entropy=ent_term, entropy_coeff=config.entropy_coeff,
                                  kl=kl_term, kl_coef=config.kl_coef)
                loss.backward()
                values = dict(pg_metrics)
                values["entropy"] = float(masked_mean(entropy.detach(), part.response_mask))
                stats.add_tokens(values, float(part.response_mask.sum().item()))
                losses = {"pg_loss": float(pg_loss.item())}
                if kl_term is not None:
                    losses["kl_loss"] = float(kl_term.item())
                stats.add_losses(losses)
            grad_norm = clipped_step(optimizer, params, config.grad_clip)
            stats.optimizer_steps += 1
            if math.isfinite(grad_norm):
                stats.grad_norm_sum += grad_norm
            else:
                stats.skipped_steps += 1
            optimizer.zero_grad(set_to_none=True)
            if between_steps is not None:
                between_steps()
    return stats
