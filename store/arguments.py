"""Checks of plain arguments that every layer makes the same way.

``store`` is the bottom of the dependency graph, so ``workers`` and ``api`` can share these
with it; the one rule, written once: a count, limit, size or version is an ``int`` (``True``
is not a number here), at least a given minimum, and a wrong one is a ValueError naming the
argument and the value it got.
"""

from __future__ import annotations

from typing import Any

__all__ = ["whole_number"]


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
