"""EGPO advantages: hand-worked cases for both variants, loop equivalence, sign preservation,
zero-advantage and no-CoT rules, the variant registry and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trainer_loop_reference import loop_cot_mask, loop_egpo_advantages, loop_grpo_scalars

from workers.trainer.egpo import (
    EGPO_VARIANTS,
    egpo_advantages,
    grpo_advantages,
    mean_cot_entropy,
)

S, E = 151667, 151668


def two_responses(
    entropy_first: float, entropy_second: float
) -> dict[str, torch.Tensor | list[str]]:
    """One group of two: rewards 1 and 0, so without std normalisation A = +0.5 and -0.5.

    Each response is ``<think> t t </think> answer answer``; the CoT tokens carry the given
    entropy and the answer tokens a large one that must not count.
    """
    responses = torch.tensor([[S, 5, 6, E, 7, 8], [S, 5, 6, E, 7, 8]])
    entropies = torch.tensor(
        [
            [9.0, entropy_first, entropy_first, 9.0, 9.0, 9.0],
            [9.0, entropy_second, entropy_second, 9.0, 9.0, 9.0],
        ],
        dtype=torch.float64,
    )
    rewards = torch.zeros(2, 6, dtype=torch.float64)
    rewards[0, -1] = 1.0
    return {
        "token_level_rewards": rewards,
        "response_mask": torch.ones(2, 6, dtype=torch.float64),
        "index": ["g", "g"],
        "entropies": entropies,
        "responses": responses,
    }


def egpo(batch: dict[str, torch.Tensor | list[str]], **kwargs: object) -> list[float]:
    options: dict[str, object] = {
        "cot_start_id": S,
        "cot_end_id": E,
        "norm_adv_by_std": False,
    }
    options.update(kwargs)
    advantages, returns = egpo_advantages(**batch, **options)  # type: ignore[arg-type]
    assert returns is advantages
    return advantages[:, 0].tolist()


@pytest.mark.parametrize(
    ("variant", "entropies", "expected"),
    [
        # clip: A + 0.4 * clip(H, -|A|/2, |A|/2), |A| = 0.5 so the bound is 0.25
        ("clip", (0.3, 0.1), (0.5 + 0.4 * 0.25, -0.5 + 0.4 * 0.1)),
        ("clip", (0.1, 0.0), (0.5 + 0.04, -0.5)),
        ("clip", (2.0, 2.0), (0.6, -0.4)),
        # paper: A + min(0.4 * H, |A|/2)
        ("paper", (0.3, 1.0), (0.5 + 0.12, -0.5 + 0.25)),
        ("paper", (0.5, 0.5), (0.7, -0.3)),
        ("paper", (0.0, 0.0), (0.5, -0.5)),
    ],
)
def test_hand_worked(
    variant: str, entropies: tuple[float, float], expected: tuple[float, float]
) -> None:
    got = egpo(two_responses(*entropies), variant=variant)
    assert got == pytest.approx(expected, abs=1e-12)


def test_defaults_are_clip_lambda_0_4_alpha_2() -> None:
    batch = two_responses(0.3, 0.1)
    assert egpo(batch) == egpo(batch, variant="clip", lam=0.4, alpha=2.0)


def test_lambda_and_alpha_change_the_bonus() -> None:
    # clip with lam=1, alpha=4: bound 0.125; H=0.3 -> +0.125; H=0.1 -> +0.1
    assert egpo(two_responses(0.3, 0.1), lam=1.0, alpha=4.0) == pytest.approx([0.625, -0.4])


def test_with_std_normalisation() -> None:
    got = egpo(two_responses(0.3, 0.1), norm_adv_by_std=True, variant="paper")
    a = 0.5 / ((0.5**0.5) + 1e-6)
    assert got == pytest.approx([a + 0.12, -a + 0.04], abs=1e-9)


def test_only_cot_tokens_in_the_mask_count() -> None:
    batch = two_responses(0.2, 0.2)
    entropies = batch["entropies"]
    assert isinstance(entropies, torch.Tensor)
    entropies[0, 2] = 0.6  # second CoT token of response 0
    mask = batch["response_mask"]
    assert isinstance(mask, torch.Tensor)
    # Mean over both CoT tokens: (0.2 + 0.6) / 2 = 0.4 -> paper bonus min(0.16, 0.25)
    assert egpo(batch, variant="paper")[0] == pytest.approx(0.66)
    mask[0, 2] = 0.0  # now only the first CoT token counts: H = 0.2 -> bonus 0.08
    advantages, _ = egpo_advantages(
        **batch, cot_start_id=S, cot_end_id=E, norm_adv_by_std=False, variant="paper"
    )  # type: ignore[arg-type]
    assert advantages[0, 0].item() == pytest.approx(0.58)
    assert advantages[0, 2].item() == 0.0  # masked positions stay zero


def test_no_cot_tokens_no_bonus() -> None:
    batch = two_responses(0.3, 0.3)
    batch["responses"] = torch.tensor([[1, 5, 6, 2, 7, 8], [S, E, 6, 2, 7, 8]])
    for variant in ("clip", "paper"):
        assert egpo(batch, variant=variant) == pytest.approx([0.5, -0.5], abs=0)


def test_zero_advantage_gets_no_bonus() -> None:
    batch = two_responses(0.7, 0.7)
    rewards = batch["token_level_rewards"]
    assert isinstance(rewards, torch.Tensor)
    rewards[1, -1] = 1.0  # equal rewards: A = 0 for both
    for variant in ("clip", "paper"):
        for norm in (True, False):
            advantages, _ = egpo_advantages(
                **batch, cot_start_id=S, cot_end_id=E, variant=variant, norm_adv_by_std=norm
            )  # type: ignore[arg-type]
            assert torch.count_nonzero(advantages) == 0


def test_singleton_keeps_its_score_plus_bonus() -> None:
    batch = two_responses(0.3, 0.1)
    batch["index"] = ["a", "b"]  # two singletons: A = score (1 and 0)
    assert egpo(batch, variant="paper") == pytest.approx([1.0 + 0.12, 0.0])


def random_egpo_batch(seed: int) -> dict[str, object]:
    rng = np.random.default_rng(seed)
    uids: list[str] = []
    for g in range(int(rng.integers(1, 8))):
        uids += [f"q{g}"] * int(rng.integers(1, 6))
    bs, length = len(uids), int(rng.integers(2, 20))
    rewards = np.zeros((bs, length))
    rewards[:, -1] = rng.choice([0.0, 1.0, -1.0, 0.3], size=bs)
    tokens = rng.choice([S, E, 1, 2, 3], size=(bs, length), p=[0.12, 0.12, 0.26, 0.25, 0.25])
    mask = (rng.random((bs, length)) < 0.85).astype(np.float64)
    entropies = rng.random((bs, length)) * 3.0
    return {
        "token_level_rewards": torch.from_numpy(rewards),
        "response_mask": torch.from_numpy(mask),
        "index": uids,
        "entropies": torch.from_numpy(entropies),
        "responses": torch.from_numpy(tokens),
    }


@pytest.mark.parametrize("seed", range(15))
@pytest.mark.parametrize("variant", ["clip", "paper"])
@pytest.mark.parametrize("norm", [True, False])
def test_equals_loop_reference(seed: int, variant: str, norm: bool) -> None:
    batch = random_egpo_batch(seed)
    advantages, _ = egpo_advantages(
        **batch,  # type: ignore[arg-type]
        cot_start_id=S,
        cot_end_id=E,
        lam=0.4,
        alpha=2.0,
        variant=variant,
        norm_adv_by_std=norm,
    )
    rewards = batch["token_level_rewards"]
    mask = batch["response_mask"]
    entropies = batch["entropies"]
    responses = batch["responses"]
    assert isinstance(rewards, torch.Tensor) and isinstance(mask, torch.Tensor)
    assert isinstance(entropies, torch.Tensor) and isinstance(responses, torch.Tensor)
    scalars = loop_grpo_scalars(
        rewards.sum(-1).tolist(), batch["index"], norm_adv_by_std=norm, epsilon=1e-6
    )  # type: ignore[arg-type]
    cot = loop_cot_mask(responses.tolist(), mask.tolist(), start=S, end=E)
    expected = loop_egpo_advantages(
        scalars, entropies.tolist(), cot, lam=0.4, alpha=2.0, variant=variant
    )
    torch.testing.assert_close(
        advantages, torch.tensor(expected, dtype=torch.float64).unsqueeze(-1) * mask
    )


def test_mean_cot_entropy_rows_without_cot() -> None:
    entropies = torch.tensor([[1.0, 3.0], [5.0, 5.0]])
    mask = torch.tensor([[True, True], [False, False]])
    mean, has_cot = mean_cot_entropy(entropies, mask)
    assert mean.tolist() == [2.0, 0.0]
    assert has_cot.tolist() == [True, False]


def test_bf16_entropies_are_accepted() -> None:
    batch = two_responses(0.25, 0.25)
    entropies = batch["entropies"]
    assert isinstance(entropies, torch.Tensor)
    batch["entropies"] = entropies.to(torch.bfloat16)
    assert egpo(batch, variant="paper") == pytest.approx([0.6, -0.4])


@st.composite
def egpo_cases(draw: st.DrawFn) -> tuple[dict[str, object], str, float, float]:
    bs = draw(st.integers(1, 12))
    length = draw(st.integers(1, 10))
    groups = draw(st.lists(st.integers(0, 3), min_size=bs, max_size=bs))
    rewards = draw(
        st.lists(
            st.sampled_from([0.0, 1.0, -1.0, 0.25]) | st.floats(-5, 5, width=32),
            min_size=bs,
            max_size=bs,
        )
    )
    tokens = draw(
        st.lists(st.sampled_from([S, E, 1, 2]), min_size=bs * length, max_size=bs * length)
    )
    entropies = draw(
        st.lists(st.floats(0, 12, width=32), min_size=bs * length, max_size=bs * length)
    )
    variant = draw(st.sampled_from(EGPO_VARIANTS.names()))
    alpha = draw(st.floats(1.05, 8.0))
    lam = draw(st.floats(0.0, 0.95 * alpha if variant == "clip" else 10.0))
    token_rewards = torch.zeros(bs, length)
    token_rewards[:, -1] = torch.tensor(rewards)
    batch = {
        "token_level_rewards": token_rewards,
        "response_mask": torch.ones(bs, length),
        "index": groups,
        "entropies": torch.tensor(entropies).reshape(bs, length),
        "responses": torch.tensor(tokens).reshape(bs, length),
    }
    return batch, variant, lam, alpha


@settings(max_examples=300, deadline=None)
@given(egpo_cases(), st.booleans())
def test_sign_is_preserved_and_bonus_bounded(
    case: tuple[dict[str, object], str, float, float], norm: bool
) -> None:
    batch, variant, lam, alpha = case
    base, _ = grpo_advantages(
        batch["token_level_rewards"],  # type: ignore[arg-type]
        batch["response_mask"],  # type: ignore[arg-type]
        batch["index"],
        norm_adv_by_std=norm,
    )
    advantages, _ = egpo_advantages(
        **batch,  # type: ignore[arg-type]
        cot_start_id=S,
        cot_end_id=E,
        lam=lam,
        alpha=alpha,
        variant=variant,
        norm_adv_by_std=norm,
    )
    a, a_egpo = base[:, 0], advantages[:, 0]
    nonzero = a != 0
    assert torch.equal(torch.sign(a_egpo[nonzero]), torch.sign(a[nonzero]))
    assert torch.count_nonzero(a_egpo[~nonzero]) == 0
    bonus = a_egpo - a
    assert bool((bonus >= 0).all())
    assert bool((bonus <= a.abs() / alpha * (lam if variant == "clip" else 1.0) + 1e-6).all())


def test_registry_lists_both_variants() -> None:
    assert EGPO_VARIANTS.names() == ("clip", "paper")


def test_registry_refuses_a_second_clip() -> None:
    with pytest.raises(ValueError, match="'clip' is already registered"):
        EGPO_VARIANTS.register("clip")
    assert len(EGPO_VARIANTS) == 2


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"variant": "entropy"}, ValueError, r"unknown EGPO variant 'entropy'; known: clip, paper"),
        ({"lam": -0.1}, ValueError, "lam must be >= 0"),
        ({"lam": float("nan")}, ValueError, "lam must be finite"),
        ({"alpha": 0.0}, ValueError, "alpha must be > 0"),
        ({"lam": 2.0, "alpha": 2.0}, ValueError, "'clip' needs lam < alpha"),
        ({"alpha": 1.0, "variant": "paper"}, ValueError, "'paper' needs alpha > 1"),
        ({"entropies": torch.ones(2, 5)}, ValueError, "entropies has shape"),
        ({"responses": torch.ones(2, 6, dtype=torch.long)[:, :3]}, ValueError, "responses has"),
        ({"entropies": torch.ones(2, 6, dtype=torch.long)}, TypeError, "entropies must be a float"),
        ({"responses": torch.ones(2, 6)}, TypeError, "responses must hold integer token ids"),
        ({"cot_end_id": S}, ValueError, "must differ"),
        ({"index": ["g"]}, ValueError, "index has 1 group ids"),
    ],
)
def test_bad_input(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    batch: dict[str, object] = dict(two_responses(0.1, 0.1))
    options: dict[str, object] = {"cot_start_id": S, "cot_end_id": E}
    for key, value in kwargs.items():
        (batch if key in batch else options)[key] = value
    with pytest.raises(error, match=match):
        egpo_advantages(**batch, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-0.5, float("nan"), float("inf")])
def test_bad_entropy_on_cot_tokens(bad: float) -> None:
    batch = two_responses(0.1, 0.1)
    entropies = batch["entropies"]
    assert isinstance(entropies, torch.Tensor)
    entropies[1, 1] = bad
    with pytest.raises(ValueError, match=r"nonnegative on CoT tokens; rows \[1\]"):
        egpo(batch)


def test_bad_entropy_outside_cot_is_ignored() -> None:
    batch = two_responses(0.1, 0.1)
    entropies = batch["entropies"]
    assert isinstance(entropies, torch.Tensor)
    entropies[1, 5] = float("nan")  # an answer token
    assert egpo(batch) == pytest.approx([0.54, -0.46])


def test_subnormal_advantage_keeps_its_sign() -> None:
    """A = -/+2.8e-45 (twice the smallest float32): the bonus 1.5*|A|/2 rounds to |A|, so
    A + bonus would be 0 for the negative one; the bonus is dropped there and the sign kept."""
    tiny = torch.tensor(1.4e-45)
    assert tiny.item() > 0
    rewards = torch.zeros(2, 3)
    rewards[0, -1] = -4 * tiny
    responses = torch.tensor([[S, 5, E], [S, 5, E]])
    advantages, _ = egpo_advantages(
        rewards,
        torch.ones(2, 3),
        ["g", "g"],
        torch.full((2, 3), 5.0),
        responses,
        cot_start_id=S,
        cot_end_id=E,
        lam=1.5,
        alpha=2.0,
        norm_adv_by_std=False,
    )
    assert advantages[0, 0].item() < 0 < advantages[1, 0].item()


def test_out_receives_the_egpo_advantages() -> None:
    batch = two_responses(0.2, 0.4)
    expected, _ = egpo_advantages(**batch, cot_start_id=S, cot_end_id=E)  # type: ignore[arg-type]
    out = torch.full((2, 6), 5.0, dtype=torch.float64)
    advantages, returns = egpo_advantages(  # type: ignore[arg-type]
        **batch, cot_start_id=S, cot_end_id=E, out=out)
    assert advantages is out and returns is out and torch.equal(out, expected)
    with pytest.raises(ValueError, match="out has shape"):
        egpo_advantages(**batch, cot_start_id=S, cot_end_id=E,  # type: ignore[arg-type]
                        out=torch.zeros(2, 5, dtype=torch.float64))


def test_the_math_module_defaults_are_the_run_configs() -> None:
    """``egpo_advantages`` imports with torch alone, so it cannot read ``store.events``; its
    keyword defaults must still be the run configuration's."""
    import inspect

    from store.events import EGPO_ALPHA, EGPO_LAM, EgpoConfig
    from workers.trainer.advantages import AdvantageSettings

    params = inspect.signature(egpo_advantages).parameters
    assert (params["lam"].default, params["alpha"].default) == (EGPO_LAM, EGPO_ALPHA)
    assert (EgpoConfig().lam, EgpoConfig().alpha) == (EGPO_LAM, EGPO_ALPHA)
    settings = AdvantageSettings()
    assert (settings.lam, settings.alpha, settings.variant) == (
        EGPO_LAM, EGPO_ALPHA, EgpoConfig().variant)
