"""workers.trainer against outputs of verl 0.9.1 stored in reference/verl_reference.npz.

The vectors come from reference/make_verl_reference.py (its docstring says how to rerun it);
verl itself is not needed here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from workers.trainer.egpo import grpo_advantages
from workers.trainer.logits import logprobs_and_entropy_from_logits
from workers.trainer.losses import GlobalBatchInfo, agg_loss, kl_penalty, ppo_policy_loss

REFERENCE = np.load(Path(__file__).parent / "reference" / "verl_reference.npz")
AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
KL_KINDS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl", "k1+", "abs+", "k2+", "k3+")
TOL = {"atol": 1e-6, "rtol": 1e-6}


def ref(key: str) -> np.ndarray:
    return REFERENCE[key]


def t(key: str) -> torch.Tensor:
    return torch.from_numpy(np.array(ref(key)))


def test_reference_file_is_from_verl_0_9_1() -> None:
    assert str(ref("verl_version")) == "0.9.1"


@pytest.mark.parametrize("case", ["grpo0", "grpo1", "grpo2"])
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_matches_verl(case: str, norm: bool) -> None:
    uids = ref(f"{case}/index").tolist()
    assert len(set(uids)) < len(uids)  # the batch really has groups
    advantages, returns = grpo_advantages(
        t(f"{case}/token_level_rewards"),
        t(f"{case}/response_mask"),
        uids,
        norm_adv_by_std=norm,
    )
    expected = t(f"{case}/advantages_norm{int(norm)}")
    torch.testing.assert_close(advantages, expected, **TOL)
    assert torch.equal(returns, advantages)


def test_grpo_matches_verl_with_numpy_string_index() -> None:
    advantages, _ = grpo_advantages(
        t("grpo1/token_level_rewards"), t("grpo1/response_mask"), ref("grpo1/index")
    )
    torch.testing.assert_close(advantages, t("grpo1/advantages_norm1"), **TOL)


def test_reference_batches_cover_the_edge_cases() -> None:
    """Singletons, equal-reward groups and -1 negatives are all present in the stored batches."""
    uids = np.concatenate([ref(f"grpo{k}/index") for k in range(3)])
    rewards = np.concatenate([ref(f"grpo{k}/token_level_rewards").sum(-1) for k in range(3)])
    advantages = np.concatenate([ref(f"grpo{k}/advantages_norm1").sum(-1) for k in range(3)])
    _, counts = np.unique(uids, return_counts=True)
    assert (counts == 1).any() and (counts > 4).any()
    assert (rewards == -1.0).any()
    assert (advantages == 0.0).any()  # equal-reward groups (and singletons with reward 0)
    masks = np.concatenate([ref(f"grpo{k}/response_mask").ravel() for k in range(3)])
    assert (masks == 0).any()


@pytest.mark.parametrize("case", ["ppo0", "ppo1"])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_ppo_policy_loss_matches_verl(case: str, mode: str) -> None:
    low, high, dual = ref(f"{case}/clip").tolist()
    log_prob = t(f"{case}/log_prob").requires_grad_(True)
    loss, metrics = ppo_policy_loss(
        t(f"{case}/old_log_prob"),
        log_prob,
        t(f"{case}/advantages"),
        t(f"{case}/response_mask").bool(),
        clip_ratio_low=low,
        clip_ratio_high=high,
        clip_ratio_c=dual,
        loss_agg_mode=mode,
    )
    loss.backward()
    torch.testing.assert_close(loss.detach(), t(f"{case}/{mode}/loss"), **TOL)
    assert log_prob.grad is not None
    torch.testing.assert_close(log_prob.grad, t(f"{case}/{mode}/grad"), **TOL)
    assert set(metrics) == {"pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"}
    for key, value in metrics.items():
        assert value == pytest.approx(float(ref(f"{case}/{mode}/{key}")), abs=1e-6, rel=1e-6)


def test_ppo_reference_exercises_every_clip() -> None:
    for case in ("ppo0", "ppo1"):
        assert float(ref(f"{case}/token-mean/pg_clipfrac")) > 0
        assert float(ref(f"{case}/token-mean/pg_clipfrac_lower")) > 0


@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss_matches_verl(mode: str) -> None:
    loss_mat, mask = t("agg/loss_mat"), t("agg/mask")
    torch.testing.assert_close(agg_loss(loss_mat, mask, mode), t(f"agg/{mode}/local"), **TOL)
    dp_size, tokens, seqs, factor = ref("agg/global_info").tolist()
    info = GlobalBatchInfo(
        dp_size=dp_size, batch_num_tokens=tokens, global_batch_size=seqs, loss_scale_factor=factor
    )
    torch.testing.assert_close(
        agg_loss(loss_mat, mask, mode, global_batch=info), t(f"agg/{mode}/global"), **TOL
    )


@pytest.mark.parametrize("kind", KL_KINDS)
def test_kl_penalty_matches_verl(kind: str) -> None:
    log_prob = t("kl/log_prob").requires_grad_(True)
    value = kl_penalty(log_prob, t("kl/ref_log_prob"), kind)
    value.sum().backward()
    torch.testing.assert_close(value.detach(), t(f"kl/{kind}/value"), **TOL)
    assert log_prob.grad is not None
    torch.testing.assert_close(log_prob.grad, t(f"kl/{kind}/grad"), **TOL)


@pytest.mark.parametrize("chunk_size", [1, 5, 1024])
def test_logits_matches_verl(chunk_size: int) -> None:
    log_probs, entropy = logprobs_and_entropy_from_logits(
        t("logits/logits"),
        t("logits/targets"),
        temperature=float(ref("logits/temperature")),
        chunk_size=chunk_size,
    )
    torch.testing.assert_close(log_probs, t("logits/log_probs"), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(entropy, t("logits/entropy"), atol=1e-5, rtol=1e-6)
