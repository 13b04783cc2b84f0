"""The shared check of whole-number arguments: ints at or above a minimum, nothing else."""

from __future__ import annotations

from typing import Any

import pytest

from store.arguments import whole_number


@pytest.mark.parametrize(("value", "minimum"), [(1, 1), (7, 1), (0, 0), (3, 3), (-2, -5)])
def test_whole_numbers_at_or_above_the_minimum_pass(value: int, minimum: int) -> None:
    assert whole_number("n", value, minimum=minimum) == value


@pytest.mark.parametrize(("value", "minimum", "message"), [
    (0, 1, "n must be a positive integer, got 0"),
    (True, 1, "n must be a positive integer, got True"),
    (1.0, 1, "n must be a positive integer, got 1.0"),
    ("2", 1, "n must be a positive integer, got '2'"),
    (None, 1, "n must be a positive integer, got None"),
    (-1, 0, "n must be a non-negative integer, got -1"),
    (False, 0, "n must be a non-negative integer, got False"),
    (2, 3, "n must be an integer >= 3, got 2"),
])
def test_anything_else_is_a_value_error_naming_the_argument(value: Any, minimum: int,
                                                            message: str) -> None:
    with pytest.raises(ValueError) as refused:
        whole_number("n", value, minimum=minimum)
    assert str(refused.value) == message
