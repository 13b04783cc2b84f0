"""Checks of plain arguments that every layer makes the same way.

``store`` is the bottom of the dependency graph, so ``workers`` and ``api`` can share these
with it; the one rule, written once: a count, limit, size or version is an ``int`` (``True``
is not a number here), at least a given minimum, and a wrong one is a ValueError naming the
argument and the value it got; a real number (a reward, a temperature, a duration) is an
``int`` or ``float``, finite, and never a boolean either.

The same rule for request models: :data:`WholeNumber` and :data:`RealNumber` are the pydantic
types of a client's numeric fields (strict: ``true``, ``"1"`` and ``1.5`` for a whole number
are refused, naming the field), with bounds added by ``Field(ge=..., le=...)`` where used.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import Field

__all__ = ["RealNumber", "WholeNumber", "real_number", "whole_number"]

#: A client's count, limit, size or version: an integer, never a boolean nor a string.
WholeNumber = Annotated[int, Field(strict=True)]
#: A client's real number: an integer or float, finite, never a boolean nor a string.
RealNumber = Annotated[float, Field(strict=True, allow_inf_nan=False)]


def whole_number(name: str, value: Any, *, minimum: int = 1) -> int:
    """``value`` when it is an ``int`` (not a ``bool``) of at least ``minimum``; otherwise
    ValueError ``"<name> must be a positive integer, got <value!r>"`` (``non-negative``
    for a minimum of 0, ``an integer >= <minimum>`` for any other minimum)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        if minimum == 1:
            wanted = "a positive integer"
        elif minimum == 0:
            wanted = "a non-negative integer"
        else:
            wanted = f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {wanted}, got {value!r}")
    return value


def real_number(name: str, value: Any) -> float:
    """``value`` as a float when it is a finite ``int`` or ``float`` (not a ``bool``);
    otherwise ValueError ``"<name> must be a finite number, got <value!r>"``."""
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)
