"""Per-token KL estimators between the policy and a reference policy.

From sampled-token log-probs only (J. Schulman, "Approximating KL divergence", 2020), as in
verl 0.9.1 ``kl_penalty``. With ``d = log_prob - ref_log_prob``:

- ``k1`` / ``kl``: ``d``
- ``abs``: ``|d|``
- ``k2`` / ``mse``: ``d**2 / 2``
- ``k3`` / ``low_var_kl``: ``exp(-d') + d' - 1`` with ``d'`` the clamp of ``d`` to [-20, 20],
  the result clamped to [-10, 10] (verl's numerical guards)

A kind with a trailing ``+`` (``k3+``, ``low_var_kl+``, ...) keeps that estimator's value but
takes its gradient from ``k2``, whose gradient is an unbiased estimate of the KL gradient
(straight-through).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from workers.registry import Registry
from workers.trainer.checks import require_floating, require_same_shape, require_tensor

__all__ = ["KL_ESTIMATORS", "kl_penalty"]

KlFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KL_ESTIMATORS: Registry[KlFn] = Registry("KL kind")


@KL_ESTIMATORS.register("k1", "kl")
def _k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return log_prob - ref_log_prob


@KL_ESTIMATORS.register("abs")
def _abs(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return (log_prob - ref_log_prob).abs()


@KL_ESTIMATORS.register("k2", "mse")
def _k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return 0.5 * (log_prob - ref_log_prob).square()


@KL_ESTIMATORS.register("k3", "low_var_kl")
def _k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    log_ratio = torch.clamp(ref_log_prob - log_prob, min=-20.0, max=20.0)
    estimate = torch.exp(log_ratio) - log_ratio - 1.0
    return torch.clamp(estimate, min=-10.0, max=10.0)


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate, same shape as the inputs (usually ``(bs, response_length)``).

    ``kind`` names an entry of :data:`KL_ESTIMATORS`, optionally with a trailing ``+`` for the
    straight-through k2 gradient. Gradients flow through both log-prob tensors.

    Raises TypeError for non-tensor or non-float inputs and a non-string ``kind``; ValueError
    for a shape mismatch or an unknown kind (the known ones are listed).
    """
    require_tensor("log_prob", log_prob)
    require_floating("log_prob", log_prob)
    require_same_shape("log_prob", log_prob, ref_log_prob=ref_log_prob)
    require_floating("ref_log_prob", ref_log_prob)
    if not isinstance(kind, str):
        raise TypeError(f"kind must be a str, got {type(kind).__name__} {kind!r}")
    straight_through = kind.endswith("+")
    estimator = KL_ESTIMATORS.get(kind[:-1] if straight_through else kind)
    value = estimator(log_prob, ref_log_prob)
    if not straight_through:
        return value
    surrogate = _k2(log_prob, ref_log_prob)
    return surrogate - surrogate.detach() + value.detach()
