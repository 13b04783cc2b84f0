"""The optimizer and its step, shared by every trainer of the house: the RL step
(:func:`workers.trainer.ppo.ppo_update`) and the warm start's supervised fine-tuning
(:mod:`workers.rollout.warmstart`)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

__all__ = ["adamw", "clipped_step"]


def adamw(params: Iterable[torch.nn.Parameter], *, lr: float,
          betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 0.0) -> torch.optim.AdamW:
    """AdamW over the parameters that take gradients of ``params``."""
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=lr, betas=betas,
                             eps=eps, weight_decay=weight_decay)


def clipped_step(optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter],
                 max_norm: float | None) -> float:
    """Clip the gradients of ``params`` to the global norm ``max_norm`` (None: no clip) and
    take the optimizer step, unless the norm is not finite: then the step is skipped, so a
    NaN or infinite gradient never reaches the weights. Returns the norm before clipping."""
    norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None
                                                else math.inf))
    if math.isfinite(norm):
        optimizer.step()
    return norm
