"""Loss aggregation: reduce a ``(bs, response_length)`` loss matrix to a scalar.

The modes are those of verl 0.9.1 ``agg_loss`` and are registered by name in
:data:`LOSS_AGG_MODES`:

- ``token-mean``: sum over valid tokens / number of valid tokens (of the global batch when
  :class:`GlobalBatchInfo` gives ``batch_num_tokens``), times ``dp_size``.
- ``token-sum``: sum over valid tokens, times ``dp_size``.
- ``seq-mean-token-sum``: per-sequence token sums, averaged over sequences with at least one
  valid token (or divided by ``global_batch_size``), times ``dp_size``.
- ``seq-mean-token-sum-norm``: the same divided by ``loss_scale_factor`` (default: the response
  length, ``loss_mat.shape[-1]``), as in Dr. GRPO.
- ``seq-mean-token-mean``: per-sequence token means (sum / (count + 1e-8)), averaged like
  ``seq-mean-token-sum``.

One deliberate difference from verl: a micro-batch with no valid token (or no valid sequence)
aggregates to 0 (with a zero gradient) instead of NaN (0/0), so an empty micro-batch cannot
poison an optimizer step. On every non-empty batch the result equals verl's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from workers.registry import Registry
from workers.trainer.checks import require_2d, require_same_shape

__all__ = [
    "LOSS_AGG_MODES",
    "GlobalBatchInfo",
    "agg_loss",
    "masked_mean",
    "masked_sum",
]


@dataclass(frozen=True, slots=True)
class GlobalBatchInfo:
    """How a micro-batch's loss is scaled so gradients are invariant to how a batch is split.

    ``dp_size``: data-parallel ranks (gradients are averaged over them). ``batch_num_tokens``:
    valid tokens in the global batch (``token-mean``). ``global_batch_size``: valid sequences in
    the global batch (``seq-mean-*``). ``loss_scale_factor``: divisor of
    ``seq-mean-token-sum-norm`` (default: the response length). ``None`` means "this
    micro-batch's own count", allowed only when ``dp_size == 1``.

    Raises ValueError at construction for a non-positive ``dp_size``, ``batch_num_tokens``,
    ``global_batch_size`` or ``loss_scale_factor``.
    """

    dp_size: int = 1
    batch_num_tokens: int | None = None
    global_batch_size: int | None = None
    loss_scale_factor: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.dp_size, bool) or not isinstance(self.dp_size, int) or self.dp_size < 1:
            raise ValueError(f"dp_size must be a positive int, got {self.dp_size!r}")
        for name in ("batch_num_tokens", "global_batch_size", "loss_scale_factor"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not value > 0):
                raise ValueError(f"{name} must be positive or None, got {value!r}")


_LOCAL = GlobalBatchInfo()

AggFn = Callable[[torch.Tensor, torch.Tensor, GlobalBatchInfo], torch.Tensor]
LOSS_AGG_MODES: Registry[AggFn] = Registry("loss_agg_mode")


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values * mask`` over ``dim`` (all elements when None).

    Values outside the mask are replaced by 0 first, so a NaN there cannot leak into the sum.
    """
    valid = torch.where(
        mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device)
    )
    product = valid * mask
    return product.sum() if dim is None else product.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """verl's ``masked_mean``: ``masked_sum / (mask.sum() + 1e-8)`` (0 for an empty mask).

    Raises ValueError when ``values`` and ``mask`` differ in shape.
    """
    require_same_shape("values", values, mask=mask)
    total = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / (total + 1e-8)


def _require_local(info: GlobalBatchInfo, needed: str) -> None:
    if info.dp_size > 1:
        raise ValueError(f"GlobalBatchInfo.{needed} is required when dp_size > 1")


@LOSS_AGG_MODES.register("token-mean")
def _token_mean(loss_mat: torch.Tensor, mask: torch.Tensor, info: GlobalBatchInfo) -> torch.Tensor:
    if info.batch_num_tokens is None:
        _require_local(info, "batch_num_tokens")
        denominator: torch.Tensor | int = mask.sum().clamp(min=1)
    else:
        denominator = info.batch_num_tokens
    return masked_sum(loss_mat, mask) / denominator * info.dp_size


@LOSS_AGG_MODES.register("token-sum")
def _token_sum(loss_mat: torch.Tensor, mask: torch.Tensor, info: GlobalBatchInfo) -> torch.Tensor:
    return masked_sum(loss_mat, mask) * info.dp_size


def _seq_mean(
    seq_losses: torch.Tensor, token_counts: torch.Tensor, info: GlobalBatchInfo
) -> torch.Tensor:
    """Average ``(bs,)`` sequence losses over sequences with at least one valid token."""
    seq_mask = (token_counts > 0).to(seq_losses.dtype)
    if info.global_batch_size is None:
        _require_local(info, "global_batch_size")
        denominator: torch.Tensor | int = seq_mask.sum().clamp(min=1)
    else:
        denominator = info.global_batch_size
    return masked_sum(seq_losses, seq_mask) / denominator * info.dp_size


@LOSS_AGG_MODES.register("seq-mean-token-sum")
def _seq_mean_token_sum(
    loss_mat: torch.Tensor, mask: torch.Tensor, info: GlobalBatchInfo
) -> torch.Tensor:
    return _seq_mean(masked_sum(loss_mat, mask, dim=-1), mask.sum(dim=-1), info)


@LOSS_AGG_MODES.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(
    loss_mat: torch.Tensor, mask: torch.Tensor, info: GlobalBatchInfo
) -> torch.Tensor:
    loss = _seq_mean_token_sum(loss_mat, mask, info)
    factor = info.loss_scale_factor if info.loss_scale_factor is not None else mask.shape[-1]
    return loss / factor


@LOSS_AGG_MODES.register("seq-mean-token-mean")
def _seq_mean_token_mean(
    loss_mat: torch.Tensor, mask: torch.Tensor, info: GlobalBatchInfo
) -> torch.Tensor:
    counts = mask.sum(dim=-1)
    seq_losses = masked_sum(loss_mat, mask, dim=-1) / (counts + 1e-8)
    return _seq_mean(seq_losses, counts, info)


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    global_batch: GlobalBatchInfo | None = None,
) -> torch.Tensor:
    """Aggregate ``loss_mat`` ``(bs, response_length)`` under ``mask`` (same shape) to a scalar.

    ``mode`` names an entry of :data:`LOSS_AGG_MODES`; ``global_batch`` (default: this
    micro-batch alone, one rank) sets the global normalisers. Gradients flow through
    ``loss_mat``.

    Raises TypeError/ValueError (naming the argument) for non-tensors, tensors that are not 2-D
    or differ in shape, an unknown ``mode`` (the known ones are listed), and ``dp_size > 1``
    without the global count the mode needs.
    """
    require_2d("loss_mat", loss_mat)
    require_same_shape("loss_mat", loss_mat, mask=mask)
    aggregate = LOSS_AGG_MODES.get(mode)
    if global_batch is not None and not isinstance(global_batch, GlobalBatchInfo):
        raise TypeError(
            f"global_batch must be a GlobalBatchInfo or None, got {type(global_batch).__name__}"
        )
    return aggregate(loss_mat, mask, global_batch if global_batch is not None else _LOCAL)
