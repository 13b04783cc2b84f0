"""The name registry behind EGPO variants, loss aggregation modes and KL kinds."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from workers.registry import Registry
from workers.trainer.aggregation import LOSS_AGG_MODES
from workers.trainer.kl import KL_ESTIMATORS


def test_register_and_get_with_aliases() -> None:
    registry: Registry[Callable[[int], int]] = Registry("doubler")

    @registry.register("double", "twice")
    def double(x: int) -> int:
        return 2 * x

    assert registry.get("double") is double
    assert registry.get("twice")(4) == 8
    assert registry.names() == ("double", "twice")
    assert "twice" in registry and "thrice" not in registry and 3 not in registry
    assert list(registry) == ["double", "twice"]
    assert len(registry) == 2


def test_duplicates_are_refused_and_leave_the_registry_unchanged() -> None:
    registry: Registry[Callable[[], int]] = Registry("thing")
    registry.register("a")(lambda: 1)
    with pytest.raises(ValueError, match="thing 'a' is already registered"):
        registry.register("b", "a")
    with pytest.raises(ValueError, match="repeat within one registration"):
        registry.register("c", "c")
    assert registry.names() == ("a",)
    assert registry.get("a")() == 1


def test_unknown_name_lists_the_known_ones() -> None:
    registry: Registry[Callable[[], None]] = Registry("colour")
    registry.register("red")(lambda: None)
    registry.register("blue")(lambda: None)
    with pytest.raises(ValueError, match=r"unknown colour 'green'; known: blue, red"):
        registry.get("green")
    with pytest.raises(ValueError, match="unknown colour"):
        registry.get(["red"])  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["", 3, None])
def test_bad_names(bad: object) -> None:
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        Registry("thing").register(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs at least one name"):
        Registry("thing").register()


def test_project_registries_hold_the_verl_names() -> None:
    assert LOSS_AGG_MODES.names() == (
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
        "token-mean",
        "token-sum",
    )
    assert KL_ESTIMATORS.names() == ("abs", "k1", "k2", "k3", "kl", "low_var_kl", "mse")
