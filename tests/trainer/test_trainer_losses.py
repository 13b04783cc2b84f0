"""PPO policy loss, loss aggregation, KL estimators and the actor loss: loop equivalence,
hand cases, registries and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from trainer_loop_reference import loop_agg_loss, loop_kl, loop_ppo_token_losses

from workers.trainer.aggregation import LOSS_AGG_MODES, GlobalBatchInfo
from workers.trainer.kl import KL_ESTIMATORS
from workers.trainer.losses import (
    actor_loss,
    agg_loss,
    entropy_loss,
    kl_loss,
    kl_penalty,
    masked_mean,
    ppo_policy_loss,
)

MODES = LOSS_AGG_MODES.names()


def random_tensors(seed: int, bs: int = 7, length: int = 9) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    old = rng.normal(-1.0, 1.0, size=(bs, length))
    new = old + rng.normal(size=(bs, length)) * rng.choice([0.05, 0.3, 1.0, 25.0], size=(bs, 1))
    adv = rng.normal(size=(bs, 1)) + rng.normal(size=(bs, length)) * 0.2
    adv[0] = 0.0
    lengths = rng.integers(0, length + 1, size=bs)
    lengths[1] = length
    mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.float64)
    return {
        "old": torch.from_numpy(old),
        "new": torch.from_numpy(new),
        "adv": torch.from_numpy(adv),
        "mask": torch.from_numpy(mask),
        "loss_mat": torch.from_numpy(rng.normal(size=(bs, length))),
    }


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("mode", MODES)
def test_ppo_policy_loss_equals_loop(seed: int, mode: str) -> None:
    x = random_tensors(seed)
    low, high, dual = 0.2, 0.28, 3.0
    loss, metrics = ppo_policy_loss(
        x["old"],
        x["new"],
        x["adv"],
        x["mask"],
        clip_ratio_low=low,
        clip_ratio_high=high,
        clip_ratio_c=dual,
        loss_agg_mode=mode,
    )
    losses, clipped, lower = loop_ppo_token_losses(
        x["old"].tolist(), x["new"].tolist(), x["adv"].tolist(), low=low, high=high, dual=dual
    )
    mask = x["mask"].tolist()
    assert loss.item() == pytest.approx(loop_agg_loss(losses, mask, mode), rel=1e-9, abs=1e-12)
    count = sum(map(sum, mask))

    def frac(flags: list[list[bool]]) -> float:
        hits = sum(
            m
            for frow, mrow in zip(flags, mask, strict=True)
            for f, m in zip(frow, mrow, strict=True)
            if f
        )
        return hits / (count + 1e-8)

    assert metrics["pg_clipfrac"] == pytest.approx(frac(clipped), abs=1e-12)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(frac(lower), abs=1e-12)
    kl = sum(
        -min(max(n - o, -20.0), 20.0) * m
        for orow, nrow, mrow in zip(x["old"].tolist(), x["new"].tolist(), mask, strict=True)
        for o, n, m in zip(orow, nrow, mrow, strict=True)
    )
    assert metrics["ppo_kl"] == pytest.approx(kl / (count + 1e-8), rel=1e-9, abs=1e-12)


def test_ppo_hand_worked_tokens() -> None:
    old = torch.zeros(1, 4)
    # ratios e^0.5 (above 1.28), e^-0.5 (below 0.8), 1, e^2 with advantages +1, +1, -1, -1
    new = torch.tensor([[0.5, -0.5, 0.0, 2.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, metrics = ppo_policy_loss(
        old, new, adv, torch.ones(1, 4), clip_ratio_high=0.28, loss_agg_mode="token-sum"
    )
    e = torch.e
    # token 0: max(-e^.5, -1.28) = -1.28; token 1: max(-e^-.5, -0.8) = -e^-.5;
    # token 2: max(1, 1) = 1; token 3: max(e^2, 1.28) = e^2 -> dual clip min(e^2, 3) = 3
    expected = -1.28 - e**-0.5 + 1.0 + 3.0
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["pg_clipfrac"] == pytest.approx(0.25)  # only token 0 clipped (token 3 not)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(0.25)
    assert metrics["ppo_kl"] == pytest.approx(-(0.5 - 0.5 + 0 + 2.0) / 4, rel=1e-6)


def test_ppo_gradient_flows_only_through_log_prob() -> None:
    x = random_tensors(1)
    new = x["new"].clone().requires_grad_(True)
    loss, _ = ppo_policy_loss(x["old"], new, x["adv"], x["mask"])
    loss.backward()
    assert new.grad is not None
    assert torch.count_nonzero(new.grad[x["mask"] == 0]) == 0
    assert torch.count_nonzero(new.grad) > 0


def test_empty_mask_gives_zero_loss_not_nan() -> None:
    for mode in MODES:
        new = torch.randn(3, 4, requires_grad=True)
        loss, metrics = ppo_policy_loss(
            torch.randn(3, 4), new, torch.randn(3, 4), torch.zeros(3, 4), loss_agg_mode=mode
        )
        loss.backward()
        assert loss.item() == 0.0
        assert new.grad is not None and torch.count_nonzero(new.grad) == 0
        assert metrics == {"pg_clipfrac": 0.0, "ppo_kl": 0.0, "pg_clipfrac_lower": 0.0}


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_equals_loop(seed: int, mode: str) -> None:
    x = random_tensors(seed)
    got = agg_loss(x["loss_mat"], x["mask"], mode)
    expected = loop_agg_loss(x["loss_mat"].tolist(), x["mask"].tolist(), mode)
    assert got.item() == pytest.approx(expected, rel=1e-9, abs=1e-12)
    info = GlobalBatchInfo(
        dp_size=2, batch_num_tokens=100, global_batch_size=12, loss_scale_factor=64
    )
    got = agg_loss(x["loss_mat"], x["mask"], mode, global_batch=info)
    expected = loop_agg_loss(
        x["loss_mat"].tolist(),
        x["mask"].tolist(),
        mode,
        dp_size=2,
        batch_num_tokens=100,
        global_batch_size=12,
        loss_scale_factor=64,
    )
    assert got.item() == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_agg_loss_hand_worked() -> None:
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert agg_loss(loss_mat, mask, "token-mean").item() == pytest.approx(18 / 5)
    assert agg_loss(loss_mat, mask, "token-sum").item() == pytest.approx(18)
    assert agg_loss(loss_mat, mask, "seq-mean-token-sum").item() == pytest.approx((3 + 15) / 2)
    assert agg_loss(loss_mat, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 5) / 2)
    assert agg_loss(loss_mat, mask, "seq-mean-token-sum-norm").item() == pytest.approx(9 / 3)


def test_nan_outside_the_mask_does_not_leak() -> None:
    loss_mat = torch.tensor([[1.0, float("nan")]])
    mask = torch.tensor([[1.0, 0.0]])
    for mode in MODES:
        assert torch.isfinite(agg_loss(loss_mat, mask, mode))


@pytest.mark.parametrize("kind", KL_ESTIMATORS.names())
@pytest.mark.parametrize("plus", ["", "+"])
def test_kl_penalty_equals_loop(kind: str, plus: str) -> None:
    rng = np.random.default_rng(0)
    log_prob = rng.normal(-2, 2, size=(5, 6))
    ref = log_prob + rng.normal(0, 1, size=(5, 6)) * rng.choice([0.1, 1, 40], size=(5, 1))
    got = kl_penalty(torch.from_numpy(log_prob), torch.from_numpy(ref), kind + plus)
    expected = [
        [loop_kl(a, b, kind + plus) for a, b in zip(row, ref_row, strict=True)]
        for row, ref_row in zip(log_prob.tolist(), ref.tolist(), strict=True)
    ]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64))


@pytest.mark.parametrize("kind", ["k1", "abs", "k3", "low_var_kl"])
def test_straight_through_kinds_take_the_k2_gradient(kind: str) -> None:
    log_prob = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, -0.5])
    kl_penalty(log_prob, ref, kind + "+").sum().backward()
    assert log_prob.grad is not None
    torch.testing.assert_close(log_prob.grad, (log_prob - ref).detach())


def test_k3_clamps() -> None:
    # d' = ref - log_prob clamped to [-20, 20]; exp(d') - d' - 1 clamped to [-10, 10]
    value = kl_penalty(torch.zeros(3), torch.tensor([30.0, -30.0, -3.0]), "k3")
    assert value.tolist() == pytest.approx([10.0, 10.0, float(np.exp(-3.0)) + 3.0 - 1.0])
    grad_input = torch.zeros(1, requires_grad=True)
    kl_penalty(grad_input, torch.tensor([30.0]), "k3").sum().backward()
    assert grad_input.grad is not None and grad_input.grad.item() == 0.0  # clamped: no gradient


def test_kl_and_entropy_loss_terms_and_actor_loss() -> None:
    x = random_tensors(4)
    log_prob = x["new"].clone().requires_grad_(True)
    kl = kl_loss(log_prob, x["old"], x["mask"], kind="low_var_kl", loss_agg_mode="token-mean")
    expected_kl = agg_loss(kl_penalty(log_prob, x["old"], "k3"), x["mask"], "token-mean")
    assert kl.item() == pytest.approx(expected_kl.item())
    entropies = x["loss_mat"].abs()
    ent = entropy_loss(entropies, x["mask"], loss_agg_mode="seq-mean-token-mean")
    assert ent.item() == pytest.approx(
        loop_agg_loss(entropies.tolist(), x["mask"].tolist(), "seq-mean-token-mean")
    )
    pg = torch.tensor(0.5, dtype=torch.float64)
    total = actor_loss(pg, entropy=ent, entropy_coeff=0.01, kl=kl, kl_coef=0.001)
    assert total.item() == pytest.approx(0.5 - 0.01 * ent.item() + 0.001 * kl.item())
    total.backward()
    assert log_prob.grad is not None and torch.count_nonzero(log_prob.grad) > 0
    assert actor_loss(pg).item() == 0.5


def test_masked_mean_matches_verl_formula() -> None:
    values = torch.tensor([[1.0, 2.0], [3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    assert masked_mean(values, mask).item() == pytest.approx(6.0 / (3 + 1e-8))
    assert masked_mean(values, mask, dim=-1).tolist() == pytest.approx([1.5, 3.0])
    assert masked_mean(values, torch.zeros(2, 2)).item() == 0.0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"loss_agg_mode": "mean"}, ValueError, "unknown loss_agg_mode 'mean'; known: seq-mean"),
        ({"clip_ratio_low": -0.1}, ValueError, "clip_ratio_low must be >= 0"),
        ({"clip_ratio_low": 1.0}, ValueError, "clip_ratio_low must be < 1"),
        ({"clip_ratio_high": -0.2}, ValueError, "clip_ratio_high must be >= 0"),
        ({"clip_ratio_c": 1.0}, ValueError, "clip_ratio_c must be > 1"),
        ({"clip_ratio_c": None}, TypeError, "clip_ratio_c must be a real number"),
        ({"advantages": torch.zeros(2, 4)}, ValueError, "advantages has shape"),
        ({"response_mask": torch.ones(3, 3)}, ValueError, "response_mask has shape"),
        ({"log_prob": torch.zeros(2, 3, 1)}, ValueError, "log_prob must have shape"),
        ({"old_log_prob": torch.zeros(2, 3, dtype=torch.long)}, TypeError, "old_log_prob must"),
        ({"advantages": torch.zeros(2, 3, dtype=torch.long)}, TypeError, "advantages must"),
        ({"log_prob": None}, TypeError, "log_prob must be a torch.Tensor"),
        ({"global_batch": {"dp_size": 2}}, TypeError, "global_batch must be a GlobalBatchInfo"),
        (
            {"global_batch": GlobalBatchInfo(dp_size=2)},
            ValueError,
            "batch_num_tokens is required when dp_size > 1",
        ),
    ],
)
def test_ppo_bad_input(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    args: dict[str, object] = {
        "old_log_prob": torch.zeros(2, 3),
        "log_prob": torch.zeros(2, 3),
        "advantages": torch.ones(2, 3),
        "response_mask": torch.ones(2, 3),
    }
    args.update(kwargs)
    with pytest.raises(error, match=match):
        ppo_policy_loss(**args)  # type: ignore[arg-type]


def test_agg_and_kl_bad_input() -> None:
    with pytest.raises(ValueError, match="mask has shape"):
        agg_loss(torch.zeros(2, 3), torch.ones(3, 2), "token-mean")
    with pytest.raises(ValueError, match="loss_mat must have shape"):
        agg_loss(torch.zeros(6), torch.ones(6), "token-mean")
    with pytest.raises(ValueError, match="global_batch_size is required when dp_size > 1"):
        agg_loss(
            torch.zeros(2, 3),
            torch.ones(2, 3),
            "seq-mean-token-sum",
            global_batch=GlobalBatchInfo(dp_size=4),
        )
    with pytest.raises(ValueError, match=r"unknown KL kind 'full'; known: abs, k1, k2, k3"):
        kl_penalty(torch.zeros(2), torch.zeros(2), "full")
    with pytest.raises(ValueError, match="unknown KL kind 'k4'"):
        kl_penalty(torch.zeros(2), torch.zeros(2), "k4+")
    with pytest.raises(TypeError, match="kind must be a str"):
        kl_penalty(torch.zeros(2), torch.zeros(2), 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ref_log_prob has shape"):
        kl_penalty(torch.zeros(2), torch.zeros(3), "k1")
    with pytest.raises(TypeError, match="entropies must be a floating-point"):
        entropy_loss(torch.ones(2, 2, dtype=torch.long), torch.ones(2, 2))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"dp_size": 0}, ValueError, "dp_size must be a positive int"),
        ({"dp_size": 2.0}, ValueError, "dp_size must be a positive int"),
        ({"batch_num_tokens": 0}, ValueError, "batch_num_tokens must be positive"),
        ({"global_batch_size": -3}, ValueError, "global_batch_size must be positive"),
        ({"loss_scale_factor": 0.0}, ValueError, "loss_scale_factor must be positive"),
    ],
)
def test_global_batch_info_bad_input(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        GlobalBatchInfo(**kwargs)  # type: ignore[arg-type]


def test_actor_loss_bad_input() -> None:
    pg = torch.tensor(1.0)
    with pytest.raises(ValueError, match="entropy is None but its coefficient is 0.01"):
        actor_loss(pg, entropy_coeff=0.01)
    with pytest.raises(ValueError, match="kl is None but its coefficient is 0.1"):
        actor_loss(pg, kl_coef=0.1)
    with pytest.raises(ValueError, match="entropy_coeff must be >= 0"):
        actor_loss(pg, entropy=torch.tensor(1.0), entropy_coeff=-1.0)
    with pytest.raises(ValueError, match="kl must be a scalar loss"):
        actor_loss(pg, kl=torch.ones(3), kl_coef=1.0)
    with pytest.raises(ValueError, match="pg_loss must be a scalar loss"):
        actor_loss(torch.ones(2))
    with pytest.raises(TypeError, match="pg_loss must be a torch.Tensor"):
        actor_loss(1.0)  # type: ignore[arg-type]
