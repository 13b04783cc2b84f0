"""GRPO advantages and group codes: loop equivalence, group-id kinds, hand cases, bad input."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from trainer_loop_reference import loop_grpo_scalars

from workers.trainer.egpo import grpo_advantages, grpo_scalar_advantages
from workers.trainer.groups import group_codes, group_mean_std


def random_batch(seed: int, *, length: int = 6) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    rng = np.random.default_rng(seed)
    uids: list[str] = []
    for g in range(int(rng.integers(1, 15))):
        uids += [f"g{g}"] * int(rng.integers(1, 9))
    rng.shuffle(uids)
    bs = len(uids)
    rewards = torch.from_numpy(rng.normal(size=(bs, length)).astype(np.float64))
    rewards[torch.from_numpy(rng.random((bs, length)) < 0.6)] = 0.0
    mask = torch.from_numpy((rng.random((bs, length)) < 0.8).astype(np.float64))
    return rewards, mask, uids


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_equals_loop_reference(seed: int, norm: bool) -> None:
    rewards, mask, uids = random_batch(seed)
    advantages, returns = grpo_advantages(rewards, mask, uids, norm_adv_by_std=norm)
    scores = rewards.sum(-1).tolist()
    expected = torch.tensor(
        loop_grpo_scalars(scores, uids, norm_adv_by_std=norm, epsilon=1e-6), dtype=torch.float64
    )
    torch.testing.assert_close(advantages, expected.unsqueeze(-1) * mask, atol=1e-9, rtol=1e-9)
    assert returns is advantages


def test_hand_worked_group() -> None:
    # Group "a": scores 1, 0, 0 -> mean 1/3, unbiased std sqrt(1/3); group "b" is a singleton.
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.7]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    advantages, _ = grpo_advantages(rewards, mask, ["a", "a", "a", "b"])
    std = (1 / 3) ** 0.5
    first = (1 - 1 / 3) / (std + 1e-6)
    other = (0 - 1 / 3) / (std + 1e-6)
    expected = torch.tensor([[first, first], [other, 0.0], [other, other], [0.7, 0.7]])
    torch.testing.assert_close(advantages, expected)


def test_no_std_normalisation_is_score_minus_mean() -> None:
    rewards = torch.tensor([[3.0], [1.0], [5.0]])
    advantages, _ = grpo_advantages(rewards, torch.ones(3, 1), [7, 7, 8], norm_adv_by_std=False)
    assert advantages.flatten().tolist() == [1.0, -1.0, 5.0]


def test_equal_rewards_give_exactly_zero_even_when_not_representable() -> None:
    """verl's float32 mean of [0.1]*3 can leave a rounding residue that 1/(std+1e-6) inflates to
    ~0.1; the float64 group statistics here give the exact answer, 0."""
    rewards = torch.zeros(3, 4)
    rewards[:, 1] = 0.07
    rewards[:, 3] = 0.03
    advantages, _ = grpo_advantages(rewards, torch.ones(3, 4), ["x", "x", "x"])
    assert torch.count_nonzero(advantages) == 0


def test_negative_sample_joins_its_group() -> None:
    rewards = torch.tensor([[1.0], [1.0], [-1.0]])  # two successes, one failed attempt (-1)
    advantages, _ = grpo_advantages(rewards, torch.ones(3, 1), ["u", "u", "u"])
    assert advantages[2, 0] < 0 < advantages[0, 0]
    assert advantages[0, 0] == advantages[1, 0]


def test_group_ids_of_every_kind_give_the_same_advantages() -> None:
    rewards, mask, uids = random_batch(3)
    mapping = {u: i for i, u in enumerate(sorted(set(uids)))}
    ints = [mapping[u] * 11 for u in uids]
    uuids = {u: uuid.uuid4() for u in set(uids)}
    expected, _ = grpo_advantages(rewards, mask, uids)
    for index in (
        tuple(uids),
        np.array(uids),
        np.array(uids, dtype=object),
        ints,
        np.array(ints, dtype=np.int32),
        torch.tensor(ints),
        torch.tensor(ints, dtype=torch.float32),
        [uuids[u] for u in uids],
    ):
        got, _ = grpo_advantages(rewards, mask, index)
        torch.testing.assert_close(got, expected, atol=0.0, rtol=0.0)


def test_group_codes_partition_like_equality() -> None:
    index = ["b", "a", "b", ("t", 1), "a", ("t", 1), 3]
    codes = group_codes(index, size=len(index)).tolist()
    for i in range(len(index)):
        for j in range(len(index)):
            assert (codes[i] == codes[j]) == (index[i] == index[j])


def first_appearance_codes(index: list[object]) -> list[int]:
    """Plain loop: each new id gets the next code, in order of first appearance."""
    seen: dict[object, int] = {}
    return [seen.setdefault(uid, len(seen)) for uid in index]


class Uids(Sequence[object]):
    """A sequence that is neither a list nor a tuple nor an array."""

    def __init__(self, items: list[object]) -> None:
        self._items = items

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        return self._items[i]


@pytest.mark.parametrize("seed", range(4))
def test_group_codes_of_every_sequence_kind_are_first_appearance_order(seed: int) -> None:
    rng = np.random.default_rng(seed)
    bs = 3000
    ids = rng.integers(0, int(rng.integers(1, 800)), size=bs)
    strings = [f"prompt-{i:06d}" for i in ids]
    expected = first_appearance_codes(strings)  # type: ignore[arg-type]
    for index in (
        strings,
        tuple(strings),
        Uids(strings),  # type: ignore[arg-type]
        np.array(strings),
        np.array(strings, dtype=object),
        [(int(i), "t") for i in ids],
        [uuid.UUID(int=int(i)) for i in ids],
        [int(i) * 7919 for i in ids],
    ):
        copy = list(index)
        assert group_codes(index, size=bs).tolist() == expected
        assert list(index) == copy  # the ids are left as they were
    # Numeric arrays and tensors are coded in sorted order: the same partition.
    for index in (ids, torch.from_numpy(ids), ids.astype(np.float32)):
        codes = group_codes(index, size=bs)
        assert torch.equal(torch.unique(codes, return_inverse=True)[1], codes)
        assert first_appearance_codes(codes.tolist()) == expected


def test_group_codes_single_group_and_all_singletons() -> None:
    assert group_codes(["u"] * 5, size=5).tolist() == [0] * 5
    assert group_codes([f"u{i}" for i in range(5)], size=5).tolist() == [0, 1, 2, 3, 4]
    assert group_codes([], size=0).tolist() == []


def test_group_codes_refuse_a_repeated_nan_object_and_unhashable_ids() -> None:
    nan = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        group_codes(["a", nan, "a", nan], size=4)
    with pytest.raises(TypeError, match="unhashable"):
        group_codes(["a", "b", {"c": 1}], size=3)


@pytest.mark.parametrize("seed", range(5))
def test_group_mean_std_equals_loop(seed: int) -> None:
    rng = np.random.default_rng(seed)
    codes = torch.from_numpy(rng.integers(0, 6, size=40))
    codes = torch.unique(codes, return_inverse=True)[1]
    scores = torch.from_numpy(rng.normal(size=40))
    means, stds = group_mean_std(scores, codes)
    for i in range(40):
        members = scores[codes == codes[i]]
        if len(members) == 1:
            assert (means[i].item(), stds[i].item()) == (0.0, 1.0)
        else:
            assert means[i].item() == pytest.approx(members.mean().item(), abs=1e-12)
            assert stds[i].item() == pytest.approx(members.std().item(), abs=1e-12)


def test_float32_in_float32_out_and_no_grad() -> None:
    rewards = torch.rand(4, 3, requires_grad=True)
    advantages, _ = grpo_advantages(rewards, torch.ones(4, 3), [0, 0, 1, 1])
    assert advantages.dtype == torch.float32
    assert not advantages.requires_grad


def test_empty_batch() -> None:
    advantages, _ = grpo_advantages(torch.zeros(0, 5), torch.zeros(0, 5), [])
    assert advantages.shape == (0, 5)


def test_scalar_advantages_are_the_broadcast_value() -> None:
    rewards, mask, uids = random_batch(9)
    scalars = grpo_scalar_advantages(rewards, uids)
    advantages, _ = grpo_advantages(rewards, mask, uids)
    torch.testing.assert_close(advantages, scalars.unsqueeze(-1) * mask)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"index": ["a", "b"]}, ValueError, "index has 2 group ids but the batch has 3"),
        ({"index": "abc"}, TypeError, "single str"),
        ({"index": [["a"], ["a"], ["b"]]}, TypeError, "unhashable"),
        ({"index": [1.0, float("nan"), 1.0]}, ValueError, "NaN"),
        ({"index": np.array([1.0, np.nan, 1.0])}, ValueError, "NaN"),
        ({"index": torch.tensor([1.0, float("nan"), 1.0])}, ValueError, "NaN"),
        ({"index": np.zeros((3, 1))}, ValueError, "one-dimensional"),
        ({"index": 5}, TypeError, "index must be a sequence"),
        ({"response_mask": torch.ones(3, 4)}, ValueError, "response_mask has shape"),
        ({"token_level_rewards": torch.ones(3)}, ValueError, "token_level_rewards must have shape"),
        ({"token_level_rewards": torch.ones(3, 2, dtype=torch.long)}, TypeError, "floating"),
        ({"token_level_rewards": [[1.0, 0.0]] * 3}, TypeError, "torch.Tensor"),
        ({"epsilon": -1e-6}, ValueError, "epsilon must be >= 0"),
        ({"epsilon": "small"}, TypeError, "epsilon must be a real number"),
        ({"norm_adv_by_std": "yes"}, TypeError, "norm_adv_by_std must be a bool"),
        (
            {"token_level_rewards": torch.tensor([[1.0, float("inf")], [0.0, 0.0], [1.0, 0.0]])},
            ValueError,
            r"non-finite row sums at rows \[0\]",
        ),
    ],
)
def test_bad_input(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    args: dict[str, object] = {
        "token_level_rewards": torch.zeros(3, 2),
        "response_mask": torch.ones(3, 2),
        "index": ["a", "a", "b"],
    }
    args.update(kwargs)
    with pytest.raises(error, match=match):
        grpo_advantages(**args)  # type: ignore[arg-type]


def test_out_receives_the_advantages_and_is_returned() -> None:
    """A buffer passed as ``out`` is filled with what a fresh tensor would hold, step after
    step, and is the tensor returned."""
    rewards, mask, uids = random_batch(3)
    out = torch.full(mask.shape, 7.0, dtype=torch.float64)
    address = out.data_ptr()
    for step in range(3):
        step_rewards = rewards * (step + 1) + step
        expected, _ = grpo_advantages(step_rewards, mask, uids)
        advantages, returns = grpo_advantages(step_rewards, mask, uids, out=out)
        assert advantages is out and returns is out and out.data_ptr() == address
        assert torch.equal(out, expected)


@pytest.mark.parametrize(
    ("out", "error", "match"),
    [
        (torch.zeros(3, 3), ValueError, r"out has shape \(3, 3\) but response_mask has shape"),
        (torch.zeros(3, 2, dtype=torch.float64), TypeError, "out must have dtype torch.float32"),
        (torch.zeros(3, 2, dtype=torch.long), TypeError, "out must have dtype torch.float32"),
        (np.zeros((3, 2), dtype=np.float32), TypeError, "out must be a torch.Tensor or None"),
    ],
)
def test_a_bad_out_is_refused_and_left_as_it_was(out: object, error: type[Exception],
                                                  match: str) -> None:
    before = out.clone() if isinstance(out, torch.Tensor) else out.copy()  # type: ignore[attr-defined]
    with pytest.raises(error, match=match):
        grpo_advantages(torch.ones(3, 2), torch.ones(3, 2), ["a", "a", "b"], out=out)  # type: ignore[arg-type]
    assert (torch.equal(out, before) if isinstance(out, torch.Tensor)
            else np.array_equal(out, before))  # type: ignore[arg-type]
