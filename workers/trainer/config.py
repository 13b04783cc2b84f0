"""The trainer's hyperparameters, listed once with their defaults.

The run's own configuration (``RunConfig``: EGPO λ/α/variant, the model, the tokenizer) comes
from its ``run_created`` event; everything about *how* the policy is optimised lives here.
Defaults follow verl 0.9.1's actor where it has one (clip ratios 0.2/0.2, dual clip 3,
``token-mean``, low-variance KL, gradient clipping at 1).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from workers.trainer.aggregation import LOSS_AGG_MODES
from workers.trainer.kl import KL_ESTIMATORS

__all__ = ["ADVANTAGE_ESTIMATOR_NAMES", "TrainerConfig"]

#: Names accepted by ``TrainerConfig.advantage_estimator`` (None: chosen from the run config).
ADVANTAGE_ESTIMATOR_NAMES = ("grpo", "egpo")


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """How one trainer optimises a run's policy. Every field has a default.

    Batching: each step leases ``groups_per_step`` complete groups; the leased samples are
    split into mini-batches of ``mini_batch_size`` samples (None: the whole batch), one
    optimizer step each, repeated for ``ppo_epochs`` epochs; each mini-batch is processed
    ``micro_batch_size`` samples at a time with gradient accumulation.

    Advantages: ``advantage_estimator`` "grpo" or "egpo"; None picks EGPO when the run's
    ``egpo.lam`` is above 0, GRPO otherwise. ``cot_start_id``/``cot_end_id`` override the
    ``<think>``/``</think>`` ids read from the tokenizer.

    Old log-probs: with one epoch over one mini-batch they are taken from the update's own
    forward unless ``separate_scoring`` (see :mod:`workers.trainer.update`). Each sample is
    scored at the temperature it was sampled with (:mod:`workers.trainer.temperature`);
    ``temperature`` (None by default) overrides that for every sample, and the trainer logs
    the override.

    Loss: ``ppo_policy_loss`` with the clip ratios and ``loss_agg_mode``; ``entropy_coeff``
    subtracts the aggregated entropy; ``kl_coef > 0`` adds ``kl_kind`` KL to a frozen
    reference model (the run's initial weights).

    Checkpoints: ``keep_checkpoints`` newest versions are kept under ``checkpoint_root`` (None:
    ``<data_dir>/checkpoints``; a folder; or an fsspec URL, see
    :mod:`workers.checkpoint_urls`).

    Raises TypeError/ValueError at construction naming the field and the value for anything
    out of range (non-positive sizes or rates, unknown names, NaN).
    """

    # Leasing.
    groups_per_step: int = 4
    lease_seconds: float = 600.0
    max_staleness: int | None = None

    # Optimizer (AdamW).
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    grad_clip: float | None = 1.0

    # PPO.
    ppo_epochs: int = 1
    mini_batch_size: int | None = None
    micro_batch_size: int = 4
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    kl_coef: float = 0.0
    kl_kind: str = "low_var_kl"

    # Advantages.
    advantage_estimator: str | None = None
    norm_adv_by_std: bool = True
    cot_start_id: int | None = None
    cot_end_id: int | None = None

    # Log-probs: None scores each sample at the temperature it was sampled with (recorded by
    # its episode, else the run's rollout temperature); a number overrides it. Tokens per
    # logit chunk.
    temperature: float | None = None
    logit_chunk_size: int = 1024
    # True: always recompute the old log-probs in a no-grad pass before the update; False:
    # take them from the update's own forward where that is exact (workers.trainer.update).
    separate_scoring: bool = False

    # Where and how.
    device: str | None = None
    dtype: str = "float32"
    seed: int = 0
    keep_checkpoints: int = 2
    # Where checkpoints go: None for ``<data_dir>/checkpoints``, else a folder or an fsspec URL
    # (``s3://bucket/prefix``, ``file:///...``) on storage the rollout engines can read.
    checkpoint_root: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.betas, list):  # JSON has no tuples (task arguments, saved configs)
            object.__setattr__(self, "betas", tuple(self.betas))
        for name in ("groups_per_step", "ppo_epochs", "micro_batch_size", "logit_chunk_size",
                     "keep_checkpoints"):
            _positive_int(name, getattr(self, name))
        if self.mini_batch_size is not None:
            _positive_int("mini_batch_size", self.mini_batch_size)
        if self.max_staleness is not None:
            _positive_int("max_staleness", self.max_staleness, minimum=0)
        _positive_int("seed", self.seed, minimum=0)
        for name in ("lease_seconds", "lr", "adam_eps"):
            _number(name, getattr(self, name), positive=True)
        if self.temperature is not None:
            _number("temperature", self.temperature, positive=True)
        for name in ("weight_decay", "clip_ratio_low", "clip_ratio_high", "entropy_coeff",
                     "kl_coef"):
            _number(name, getattr(self, name), positive=False)
        if self.grad_clip is not None:
            _number("grad_clip", self.grad_clip, positive=True)
        if self.clip_ratio_low >= 1.0:
            raise ValueError(f"clip_ratio_low must be < 1, got {self.clip_ratio_low!r}")
        _number("clip_ratio_c", self.clip_ratio_c, positive=True)
        if self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1, got {self.clip_ratio_c!r}")
        if (not isinstance(self.betas, tuple) or len(self.betas) != 2
                or not all(isinstance(b, int | float) and not isinstance(b, bool)
                           and 0.0 <= b < 1.0 for b in self.betas)):
            raise ValueError(f"betas must be a pair of numbers in [0, 1), got {self.betas!r}")
        LOSS_AGG_MODES.get(self.loss_agg_mode)
        KL_ESTIMATORS.get(self.kl_kind.removesuffix("+"))
        if (self.advantage_estimator is not None
                and self.advantage_estimator not in ADVANTAGE_ESTIMATOR_NAMES):
            raise ValueError(f"advantage_estimator must be one of {ADVANTAGE_ESTIMATOR_NAMES} "
                             f"or None, got {self.advantage_estimator!r}")
        for name in ("norm_adv_by_std", "separate_scoring"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("cot_start_id", "cot_end_id"):
            value = getattr(self, name)
            if value is not None:
                _positive_int(name, value, minimum=0)
        if self.checkpoint_root is not None and (
                not isinstance(self.checkpoint_root, str) or not self.checkpoint_root.strip()):
            raise ValueError(f"checkpoint_root must be a non-empty string or None, got "
                             f"{self.checkpoint_root!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.device is not None and not isinstance(self.device, str):
            raise TypeError(f"device must be a string such as 'cpu' or 'cuda:0', "
                            f"got {self.device!r}")

    def replace(self, **changes: Any) -> TrainerConfig:
        """A copy with ``changes`` applied (validated like the constructor; an unknown field
        raises TypeError naming it)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        values = dataclasses.asdict(self)
        values["betas"] = list(self.betas)
        return values


def _positive_int(name: str, value: object, *, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")


def _number(name: str, value: object, *, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    if not positive and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
