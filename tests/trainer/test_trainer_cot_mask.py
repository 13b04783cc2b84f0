"""CoT masks: one hand-worked case per rule, loop equivalence, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from trainer_loop_reference import loop_cot_mask

from workers.trainer.cot import cot_mask

S, E = 151667, 151668  # Qwen3's <think> and </think>
PAD = 0


def run(tokens: list[int], mask: list[int] | None = None) -> list[int]:
    responses = torch.tensor([tokens])
    response_mask = torch.tensor([mask if mask is not None else [1] * len(tokens)])
    out = cot_mask(responses, response_mask, cot_start_id=S, cot_end_id=E)
    assert out.dtype == torch.bool
    return out[0].int().tolist()


@pytest.mark.parametrize(
    ("tokens", "mask", "expected"),
    [
        pytest.param([S, 5, 6, E, 9], None, [0, 1, 1, 0, 0], id="one block, markers excluded"),
        pytest.param([5, S, 6, 7], None, [0, 0, 1, 1], id="unclosed block runs to the end"),
        pytest.param([5, 6, E, 7], None, [1, 1, 0, 0], id="closer without opener"),
        pytest.param(
            [S, 5, E, 6, S, 7, 8, E, 9], None, [0, 1, 0, 0, 0, 1, 1, 0, 0], id="several blocks"
        ),
        pytest.param([S, 5, 6, 7, E], [1, 1, 0, 1, 1], [0, 1, 0, 1, 0], id="only inside mask"),
        pytest.param([S, 5, E, PAD, PAD], [1, 1, 1, 0, 0], [0, 1, 0, 0, 0], id="right padding"),
        pytest.param(
            [S, 5, 6, PAD], [1, 1, 1, 0], [0, 1, 1, 0], id="unclosed block stops at padding"
        ),
        pytest.param(
            [S, 5, 6, E, 7], [0, 1, 1, 1, 1], [0, 1, 1, 0, 0], id="opener outside the mask"
        ),
        pytest.param([5, 6, 7], None, [0, 0, 0], id="no markers, no CoT"),
        pytest.param([S, 5, S, 6, E, 7], None, [0, 1, 0, 1, 0, 0], id="repeated opener"),
        pytest.param([5, E, 6, E, 7], None, [1, 0, 0, 0, 0], id="repeated closer"),
        pytest.param([5, E, 6, S, 7, E], None, [1, 0, 0, 0, 1, 0], id="closer then a block"),
        pytest.param([S, E, 5], None, [0, 0, 0], id="empty block"),
        pytest.param([E], None, [0], id="lone closer"),
        pytest.param(
            [5, E, 6, S, 7, 8, 9, E, 10, 11, S, 12],
            [1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1],
            [1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
            id="multi-turn with a context turn",
        ),
    ],
)
def test_hand_worked(tokens: list[int], mask: list[int] | None, expected: list[int]) -> None:
    assert run(tokens, mask) == expected


def test_rows_are_independent() -> None:
    responses = torch.tensor([[5, E, 6], [S, 5, 6], [5, 6, 7]])
    out = cot_mask(responses, torch.ones(3, 3), cot_start_id=S, cot_end_id=E)
    assert out.int().tolist() == [[1, 0, 0], [0, 1, 1], [0, 0, 0]]


def test_empty_inputs() -> None:
    for shape in ((0, 4), (3, 0)):
        out = cot_mask(
            torch.zeros(shape, dtype=torch.long), torch.zeros(shape), cot_start_id=S, cot_end_id=E
        )
        assert out.shape == shape


@pytest.mark.parametrize("seed", range(25))
def test_equals_loop_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    bs, length = int(rng.integers(1, 12)), int(rng.integers(1, 40))
    # Small vocabulary with frequent markers so every rule fires somewhere.
    tokens = rng.choice([S, E, 1, 2, 3, 4, 5], size=(bs, length), p=[0.1, 0.1] + [0.16] * 5)
    mask = (rng.random((bs, length)) < 0.8).astype(np.int64)
    expected = loop_cot_mask(tokens.tolist(), mask.tolist(), start=S, end=E)
    out = cot_mask(torch.from_numpy(tokens), torch.from_numpy(mask), cot_start_id=S, cot_end_id=E)
    assert out.tolist() == expected


def test_accepts_int32_tokens_and_bool_mask() -> None:
    out = cot_mask(
        torch.tensor([[S, 5, E]], dtype=torch.int32),
        torch.tensor([[True, True, True]]),
        cot_start_id=S,
        cot_end_id=E,
    )
    assert out.int().tolist() == [[0, 1, 0]]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"responses": torch.ones(2, 3)}, TypeError, "responses must hold integer token ids"),
        ({"responses": torch.ones(2, 3, 1, dtype=torch.long)}, ValueError, "responses must have"),
        ({"response_mask": torch.ones(2, 4)}, ValueError, "response_mask has shape"),
        ({"cot_start_id": E}, ValueError, "must differ"),
        ({"cot_start_id": 1.5}, TypeError, "cot_start_id must be an int"),
        ({"cot_end_id": "</think>"}, TypeError, "cot_end_id must be an int"),
        ({"responses": [[1, 2, 3]]}, TypeError, "responses must be a torch.Tensor"),
    ],
)
def test_bad_input(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    args: dict[str, object] = {
        "responses": torch.ones(2, 3, dtype=torch.long),
        "response_mask": torch.ones(2, 3),
        "cot_start_id": S,
        "cot_end_id": E,
    }
    args.update(kwargs)
    with pytest.raises(error, match=match):
        cot_mask(**args)  # type: ignore[arg-type]
