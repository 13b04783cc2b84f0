"""Validation beyond the append contract (``test_append_contract.py`` runs every bad event,
limit and argument through each append path): the run configuration checked as a whole,
the JSON text shortcut deciding as the full walk, and the read arguments."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from store import errors
from store.eventlog import EventStore
from store.settings import Settings
from store.validation import validate_batch


def test_read_arguments(store: EventStore) -> None:
    with pytest.raises(errors.ValidationError, match="limit"):
        store.read_all(limit=0)
    with pytest.raises(errors.ValidationError, match="from_version"):
        store.read_stream("x", from_version=0)
    assert store.read_stream(f"missing-{uuid.uuid4().hex}") == []


def test_egpo_config_that_would_fail_at_training_is_refused_at_creation(
        store: EventStore) -> None:
    from store.events import RunCreated

    with pytest.raises(errors.ValidationError, match="egpo.lam") as info:
        store.append("run-egpo-bad", [{"type": "run_created", "run_id": "egpo-bad",
                                       "config": {"egpo": {"lam": 2.5, "alpha": 2.0}}}])
    assert info.value.field.startswith("config.egpo")
    assert store.stream_version("run-egpo-bad") == 0
    # The paper's form has no such bound, and lam 0 (plain GRPO) needs none.
    RunCreated(run_id="ok", config={"egpo": {"lam": 2.5, "alpha": 2.0, "variant": "paper"}})
    RunCreated(run_id="ok", config={"egpo": {"lam": 0, "alpha": 0.5}})


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(("value", "refused"), [
    (_nested(63), None),  # arguments (1), its "v" (2), 63 lists: 64 levels
    (_nested(64), "nested deeper than 64"),
    ({"a": _nested(62), "b": [[[[]]]] * 40}, None),  # many brackets, none too deep
    (2**63 - 1, None),
    (-(2**63 - 1), None),
    (2**63, "integer out of range"),
    ([1, {"x": -(2**63)}], "integer out of range"),
    (0.00012345678901234567, None),  # a float with 20 digits in a row
    ("1" * 40, None),  # digits in a string
    ("[[[[" * 30, None),  # brackets in a string
    (float("nan"), "finite"),
])
def test_the_text_shortcut_decides_as_the_walk(value: Any, refused: str | None) -> None:
    """The JSON text settles depth and integers for most events; whatever it cannot rule out
    is walked, so its answer is the walk's, whatever the text holds."""
    event = {"type": "tool_returned", "name": "calculator", "arguments": {"v": value}}
    if refused is None:
        assert validate_batch([event], Settings())[0].arguments == {"v": value}
    else:
        with pytest.raises(errors.ValidationError, match=refused) as info:
            validate_batch([event], Settings())
        assert info.value.field is not None and info.value.field.startswith("arguments.v")
