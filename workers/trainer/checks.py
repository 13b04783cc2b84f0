"""Argument checks shared by the trainer's pure functions.

Each check raises TypeError (wrong kind of value) or ValueError (right kind, bad value) with a
message that names the argument and the offending value or shape.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "require_tensor",
    "require_2d",
    "require_same_shape",
    "require_floating",
    "require_finite_number",
]


def require_tensor(name: str, value: object) -> torch.Tensor:
    """Return ``value`` if it is a torch.Tensor; TypeError naming ``name`` otherwise."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def require_2d(name: str, value: object) -> torch.Tensor:
    """Return ``value`` if it is a 2-D tensor ``(bs, response_length)``; error otherwise."""
    tensor = require_tensor(name, value)
    if tensor.dim() != 2:
        raise ValueError(
            f"{name} must have shape (bs, response_length), got shape {tuple(tensor.shape)}"
        )
    return tensor


def require_same_shape(reference_name: str, reference: torch.Tensor, **others: object) -> None:
    """Check that every tensor in ``others`` has the shape of ``reference``."""
    for name, value in others.items():
        tensor = require_tensor(name, value)
        if tensor.shape != reference.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but {reference_name} has shape "
                f"{tuple(reference.shape)}; they must match"
            )


def require_floating(name: str, value: torch.Tensor) -> torch.Tensor:
    """Return ``value`` if its dtype is floating point; TypeError naming the dtype otherwise."""
    if not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {value.dtype}")
    return value


def require_finite_number(
    name: str,
    value: object,
    *,
    minimum: float | None = None,
    minimum_inclusive: bool = True,
) -> float:
    """Return ``value`` as a float if it is a finite real number above ``minimum``.

    Booleans are refused (``True`` is not a sensible epsilon). Raises TypeError for non-numbers,
    ValueError for NaN, infinities and values below the minimum.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if minimum is not None:
        if minimum_inclusive and number < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
        if not minimum_inclusive and number <= minimum:
            raise ValueError(f"{name} must be > {minimum}, got {value!r}")
    return number
