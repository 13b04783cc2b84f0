"""GRPO groups: map group ids (uids) to integer codes and compute per-group statistics.

A group is every response that shares one uid (one task prompt at one policy version, plus the
negative samples attached to it). Group ids may be any hashable values (strings, ints, UUIDs);
they are mapped to integer codes once and every statistic is then a scatter over those codes,
with no Python loop over samples or groups.
"""

from __future__ import annotations

import array
import operator
from collections.abc import Sequence

import torch

__all__ = ["group_codes", "group_mean_std"]


def group_codes(index: object, *, size: int, device: torch.device | None = None) -> torch.Tensor:
    """Integer codes ``(bs,)`` (int64, values ``0..G-1``) with equal codes for equal group ids.

    ``index`` may be a 1-D torch tensor, a 1-D numpy array, or any sequence (list, tuple) of
    hashable values; strings are compared as strings, numbers as numbers. Codes are assigned in
    order of first appearance for sequences and object arrays, and in sorted order for numeric
    arrays and tensors; only equality matters to callers.

    Raises TypeError when ``index`` is a plain string, not a sequence, or holds unhashable items;
    ValueError when its length differs from ``size``, it is not one-dimensional, or it holds NaN.
    """
    if isinstance(index, str | bytes):
        raise TypeError(
            "index must be a sequence of group ids, one per response, "
            f"got a single {type(index).__name__}"
        )
    if _is_numeric_array(index):
        index = torch.as_tensor(index)
    if isinstance(index, torch.Tensor):
        if index.dim() != 1:
            raise ValueError(f"index must be one-dimensional, got shape {tuple(index.shape)}")
        _check_length(len(index), size)
        if index.is_floating_point() and bool(torch.isnan(index).any()):
            raise ValueError("index holds NaN group ids; NaN never equals itself")
        _, codes = torch.unique(index, return_inverse=True)
        return codes.to(device=device if device is not None else index.device, dtype=torch.long)
    if hasattr(index, "__array__") and hasattr(index, "tolist"):  # a numpy array of objects/str
        shape = tuple(getattr(index, "shape", ()))
        if len(shape) != 1:
            raise ValueError(f"index must be one-dimensional, got shape {shape}")
        items: Sequence[object] = index.tolist()
    elif isinstance(index, list | tuple):
        items = index
    elif isinstance(index, Sequence):
        items = list(index)
    else:
        raise TypeError(
            "index must be a sequence, numpy array or tensor of group ids, "
            f"got {type(index).__name__}"
        )
    _check_length(len(items), size)
    if not items:
        return torch.zeros(0, dtype=torch.long, device=device)
    # One pass in the interpreter's C code (no per-sample bytecode): setdefault gives each id
    # the position of its first appearance, so first[i] is where the group of sample i begins.
    first_position: dict[object, int] = {}
    try:
        first = array.array("q", list(map(first_position.setdefault, items, range(len(items)))))
    except TypeError as exc:
        raise TypeError(f"index holds an unhashable group id: {exc}") from None
    if not all(map(operator.eq, first_position, first_position)):
        raise ValueError("index holds NaN group ids; NaN never equals itself")
    positions = torch.frombuffer(first, dtype=torch.int64)
    # Sample i opens a group exactly when first[i] == i; numbering the openings in order gives
    # the codes 0..G-1 in order of first appearance.
    opens = positions == torch.arange(len(items), dtype=torch.int64)
    codes = opens.cumsum(0).sub_(1).index_select(0, positions)
    return codes.to(device=device)


def _is_numeric_array(index: object) -> bool:
    """A numpy array (or any array-like with a numpy dtype) of bools, ints or floats."""
    kind = getattr(getattr(index, "dtype", None), "kind", None)
    return hasattr(index, "__array__") and kind in ("b", "i", "u", "f")


def _check_length(length: int, size: int) -> None:
    if length != size:
        raise ValueError(
            f"index has {length} group ids but the batch has {size} responses; "
            "give exactly one group id per response"
        )


def group_mean_std(scores: torch.Tensor, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-response mean and unbiased std of its group's scores, both ``(bs,)``.

    ``scores`` is ``(bs,)``, ``codes`` the ``(bs,)`` int64 output of :func:`group_codes`. A group
    of one response gets mean 0 and std 1 (so its advantage is its own score, as in verl). The
    statistics are accumulated in float64 with a two-pass (centred) variance and returned in the
    dtype of ``scores``. Inputs are trusted (internal helper): callers validate them.
    """
    work = scores.detach().to(torch.float64)
    num_groups = int(codes.max()) + 1 if codes.numel() else 0
    counts = torch.bincount(codes, minlength=num_groups).to(torch.float64)
    sums = torch.zeros(num_groups, dtype=torch.float64, device=work.device)
    means = sums.index_add_(0, codes, work).div_(counts)
    # index_select rather than means[codes]: advanced indexing may start the intra-op thread
    # pool for a few thousand elements, which is slow when the other cores are busy.
    centred = work - means.index_select(0, codes)
    squares = torch.zeros_like(sums).index_add_(0, codes, centred * centred)
    stds = squares.div_((counts - 1).clamp_(min=1.0)).sqrt_()
    singleton = counts == 1
    means.masked_fill_(singleton, 0.0)
    stds.masked_fill_(singleton, 1.0)
    # Casting per group, then gathering, gives the same values as gathering, then casting.
    return (
        means.to(scores.dtype).index_select(0, codes),
        stds.to(scores.dtype).index_select(0, codes),
    )
