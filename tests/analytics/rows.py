"""Comparing analytics rows: exact for everything but floats, which compare approximately
(means computed by the database in numeric arithmetic may differ in the last bit)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

__all__ = ["assert_rows"]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return (a is not None and b is not None
                and math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12))
    return bool(a == b)


def assert_rows(actual: Sequence[Any], expected: Sequence[Any]) -> None:
    """``actual`` rows equal ``expected`` ones, in order, field by field."""
    assert len(actual) == len(expected), (
        f"{len(actual)} rows, expected {len(expected)}:\n{actual}\n{expected}")
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert type(a) is type(e), f"row {i}: {type(a).__name__} vs {type(e).__name__}"
        for f in fields(a):
            x, y = getattr(a, f.name), getattr(e, f.name)
            assert _same(x, y), f"row {i} field {f.name}: {x!r} != expected {y!r}\n{a}"
