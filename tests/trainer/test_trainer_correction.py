"""Off-policy correction: verl's own numbers, the identity at zero staleness, missing log-probs,
and validation of the run's correction settings."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from store.events import CorrectionConfig, RunConfig
from workers.trainer.correction import (
    CorrectionSettings,
    compute_correction,
    has_rollout_log_probs,
)
from workers.trainer.losses import ppo_policy_loss

REFERENCE = json.loads(
    (Path(__file__).parent / "reference" / "rollout_corr_reference.json").read_text())
CASES = REFERENCE["cases"]


def _settings(case: dict) -> CorrectionSettings:
    band = case["band"] or (0.5, 2.0)
    return CorrectionSettings(is_level=case["is_level"], is_threshold=case["is_threshold"],
                              rejection=case["rejection"], rejection_lower=band[0],
                              rejection_upper=band[1])


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_matches_verl_rollout_correction(case: dict) -> None:
    old = torch.tensor(case["old_log_prob"])
    rollout = torch.tensor(case["rollout_log_prob"])
    mask = torch.tensor(case["response_mask"])
    result = compute_correction(old, rollout, mask, _settings(case))

    assert torch.equal(result.response_mask, torch.tensor(case["mask_after"]))
    if case["weights"] is not None:
        expected = torch.tensor(case["weights"])
        torch.testing.assert_close(result.weights * mask, expected * mask, rtol=1e-6, atol=1e-7)
    else:
        assert torch.equal(result.weights, torch.ones_like(mask))
    assert result.metrics["correction_kl"] == pytest.approx(case["kl"], rel=1e-5, abs=1e-7)
    assert result.metrics["correction_k3_kl"] == pytest.approx(case["k3_kl"], rel=1e-5,
                                                               abs=1e-7)

    loss, _ = ppo_policy_loss(old, torch.tensor(case["log_prob"]),
                              torch.tensor(case["advantages"]), result.response_mask,
                              is_weights=result.weights)
    assert float(loss) == pytest.approx(case["pg_loss"], rel=1e-5, abs=1e-7)


def test_reference_covers_clipping_and_rejection() -> None:
    """The stored cases exercise the caps and the bands (a reference of all-ones would pass
    anything)."""
    clipped = rejected = 0
    for case in CASES:
        result = compute_correction(torch.tensor(case["old_log_prob"]),
                                    torch.tensor(case["rollout_log_prob"]),
                                    torch.tensor(case["response_mask"]), _settings(case))
        clipped += result.metrics["correction_clipped_frac"] > 0
        rejected += result.metrics["correction_rejected_frac"] > 0
    assert clipped >= 3 and rejected >= 3


@pytest.mark.parametrize("is_level", ["none", "token", "sequence"])
@pytest.mark.parametrize("rejection", ["none", "token", "sequence"])
def test_zero_staleness_is_identity(is_level: str, rejection: str) -> None:
    generator = torch.Generator().manual_seed(3)
    mask = (torch.rand((5, 7), generator=generator) > 0.3).float()
    log_probs = (-torch.rand((5, 7), generator=generator) * 4 - 0.01) * mask
    settings = CorrectionSettings(is_level=is_level, is_threshold=1.0, rejection=rejection,
                                  rejection_upper=1.0)  # the tightest settings allowed
    result = compute_correction(log_probs, log_probs.clone(), mask, settings)
    assert torch.equal(result.weights, torch.ones_like(mask))
    assert torch.equal(result.response_mask, mask)
    assert result.metrics["correction_ratio_mean"] == 1.0
    assert result.metrics["correction_kl"] == 0.0
    assert result.metrics["correction_clipped_frac"] == 0.0
    assert result.metrics["correction_rejected_frac"] == 0.0

    advantages = torch.randn((5, 7), generator=generator)
    new = log_probs + 0.1 * torch.randn((5, 7), generator=generator)
    plain, _ = ppo_policy_loss(log_probs, new, advantages, mask)
    corrected, _ = ppo_policy_loss(log_probs, new, advantages, result.response_mask,
                                   is_weights=result.weights)
    assert torch.equal(plain, corrected)


def test_rows_without_rollout_log_probs_are_uncorrected_and_counted() -> None:
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    old = torch.tensor([[-0.1, -0.2, -0.3], [-2.0, -3.0, 0.0], [0.0, 0.0, 0.0]])
    rollout = torch.tensor([[-3.0, -3.0, -3.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert has_rollout_log_probs(rollout, mask).tolist() == [True, False, False]
    settings = CorrectionSettings(is_level="token", is_threshold=2.0, rejection="token",
                                  rejection_upper=100.0)
    result = compute_correction(old, rollout, mask, settings)
    # Row 0 is far off-policy: every token capped at 2.
    assert result.weights[0].tolist() == [2.0, 2.0, 2.0]
    # Row 1 has no rollout log-probs: weight 1 (not a made-up ratio) and never rejected.
    assert result.weights[1].tolist() == [1.0, 1.0, 1.0]
    assert torch.equal(result.response_mask[1], mask[1])
    assert result.metrics["correction_uncorrected_samples"] == 1.0
    assert result.metrics["correction_tokens"] == 3.0
    assert result.metrics["correction_clipped_frac"] == 1.0
    assert result.metrics["correction_ratio_max"] == pytest.approx(math.exp(2.9), rel=1e-5)


def test_sequence_rejection_drops_whole_rows() -> None:
    mask = torch.ones((2, 4))
    rollout = torch.full((2, 4), -1.0)
    old = rollout.clone()
    old[1, 0] = -3.0  # one token far less likely under the training policy
    settings = CorrectionSettings(is_level="none", rejection="sequence", rejection_upper=2.0)
    result = compute_correction(old, rollout, mask, settings)
    assert result.response_mask.tolist() == [[1.0] * 4, [0.0] * 4]
    assert result.metrics["correction_rejected_frac"] == 0.5
    token = compute_correction(old, rollout, mask, CorrectionSettings(
        is_level="none", rejection="token", rejection_upper=2.0))
    assert token.response_mask.tolist() == [[1.0] * 4, [0.0, 1.0, 1.0, 1.0]]


@pytest.mark.parametrize(("field", "value"), [
    ("is_level", "tokens"), ("is_threshold", 0.5), ("is_threshold", float("inf")),
    ("rejection", "batch"), ("rejection_upper", 0.9), ("rejection_lower", 1.5),
    ("rejection_lower", 0.0),
])
def test_run_config_refuses_out_of_range_correction(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as info:
        RunConfig.model_validate({"correction": {field: value}})
    assert any(error["loc"] == ("correction", field) for error in info.value.errors())
    with pytest.raises(ValueError, match=field):
        CorrectionSettings(**{field: value})


def test_default_correction_is_token_tis_2() -> None:
    config = RunConfig().correction
    assert config == CorrectionConfig(is_level="token", is_threshold=2.0, rejection="none")
    assert CorrectionSettings.from_config(config).band == (0.5, 2.0)
