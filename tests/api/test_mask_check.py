"""The remote-rollout mask check and its vectorised prefix comparison, against plain loop
references on seeded random buffers."""

from __future__ import annotations

import numpy as np
import pytest

from api.gateway.rollout_buffer import check_mask, first_divergence


def loop_first_divergence(a: list[int], b: list[int]) -> int | None:
    for i in range(min(len(a), len(b))):
        if a[i] != b[i]:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def loop_check(buffer: list[int] | None, prompt: list[int], mask: list[int] | None
               ) -> tuple[str, list[str]]:
    """Reference of ``check_mask``'s verdict, written out case by case."""
    if buffer is None:
        return ("mismatch", ["mask_on_first_call"]) if mask else ("first_call", [])
    reasons = []
    if len(prompt) < len(buffer):
        reasons.append("prompt_shorter_than_buffer")
    elif prompt[: len(buffer)] != buffer:
        reasons.append("prefix_mismatch")
    if mask is None:
        reasons.append("mask_missing")
    else:
        if len(mask) != len(prompt) - len(buffer):
            reasons.append("mask_length")
        if any(v != 0 for v in mask):
            reasons.append("mask_marks_generated")
    return ("mismatch" if reasons else "ok"), reasons


@pytest.mark.parametrize("seed", range(30))
def test_check_mask_matches_the_loop_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    buffer = rng.integers(0, 50, int(rng.integers(0, 40))).tolist()
    prompt = list(buffer)
    case = seed % 6
    if case == 1:  # truncated context
        prompt = prompt[: max(0, len(prompt) - 5)]
    elif case == 2 and prompt:  # rewritten history
        prompt[int(rng.integers(0, len(prompt)))] += 1
    prompt += rng.integers(0, 50, int(rng.integers(0, 20))).tolist()
    new = len(prompt) - len(buffer)
    mask: list[int] | None = [0] * max(new, 0)
    if case == 3:
        mask = None
    elif case == 4:
        mask = [0] * (max(new, 0) + 1)
    elif case == 5 and mask:
        mask[-1] = 1
    given_buffer = None if seed % 10 == 9 else buffer
    check = check_mask(given_buffer, prompt, mask)
    status, reasons = loop_check(given_buffer, prompt, mask)
    assert (check.status, list(check.reasons)) == (status, reasons)
    if given_buffer is not None:
        assert check.new_tokens == new and check.buffer_length == len(buffer)
        assert check.divergence == loop_first_divergence(prompt[: len(buffer)], buffer)


@pytest.mark.parametrize("seed", range(20))
def test_first_divergence_matches_the_loop_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 3, int(rng.integers(0, 15)))
    b = rng.integers(0, 3, int(rng.integers(0, 15))) if seed % 3 else a[: len(a) // 2]
    assert first_divergence(a, b) == loop_first_divergence(a.tolist(), b.tolist())


def test_exact_cases() -> None:
    ok = check_mask([1, 2, 3], [1, 2, 3, 9, 9], [0, 0])
    assert ok.status == "ok" and ok.to_dict()["new_tokens"] == 2
    first = check_mask(None, [1, 2], None)
    assert first.status == "first_call" and first.prompt_length == 2
    shrunk = check_mask([1, 2, 3], [1, 2], [])
    assert shrunk.reasons == ("prompt_shorter_than_buffer", "mask_length")
    assert shrunk.divergence == 2
    with pytest.raises(TypeError, match="1-d sequence"):
        check_mask([1], [[1, 2]], None)
