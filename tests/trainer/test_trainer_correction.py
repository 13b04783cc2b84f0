"""Off-policy correction: verl's own numbers for every mode, a plain-loop reference, the
identity at zero staleness, padding that holds NaN, missing log-probs, and validation of the
run's correction settings."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any, get_args

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from store.events import REJECTION_MODES as STORED_MODES
from store.events import CorrectionConfig, RunConfig
from tests.trainer.trainer_loop_reference import loop_correction
from workers.trainer.correction import (
    BYPASS_LOSSES,
    IS_LEVELS,
    REJECTION_MODES,
    bypass_policy_loss,
    compute_correction,
    has_rollout_log_probs,
)
from workers.trainer.losses import ppo_policy_loss

REFERENCE = np.load(Path(__file__).parent / "reference" / "rollout_corr_reference.npz")
CASES = [str(c) for c in REFERENCE["cases"]]
TOL = {"rtol": 1e-6, "atol": 1e-6}
CLIP = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}


def _case(name: str) -> tuple[dict[str, torch.Tensor], CorrectionConfig, str]:
    index = int(REFERENCE[f"{name}/inputs"])
    tensors = {field: torch.from_numpy(np.array(REFERENCE[f"inputs{index}/{field}"]))
               for field in ("old_log_prob", "rollout_log_prob", "response_mask",
                             "advantages", "log_prob")}
    spec = json.loads(str(REFERENCE[f"{name}/settings"]))
    return tensors, CorrectionConfig.model_validate(spec["correction"]), spec["loss_agg_mode"]


def _ref(name: str, field: str) -> torch.Tensor:
    return torch.from_numpy(np.array(REFERENCE[f"{name}/{field}"]))


def test_reference_file_is_from_verl_0_9_1() -> None:
    assert str(REFERENCE["verl_version"]) == "0.9.1"


def _our_loss(data: dict[str, torch.Tensor], settings: CorrectionConfig, agg: str
              ) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """``(loss, d loss / d log_prob, correction)`` of this project for a reference case."""
    mask = data["response_mask"]
    log_prob = data["log_prob"].clone().requires_grad_(True)
    result = None
    if settings.mode == "bypass":
        loss, _ = bypass_policy_loss(data["rollout_log_prob"], log_prob, data["advantages"],
                                     mask, settings, loss_agg_mode=agg, **CLIP)
    else:
        result = compute_correction(data["old_log_prob"], data["rollout_log_prob"], mask,
                                    settings)
        loss, _ = ppo_policy_loss(data["old_log_prob"], log_prob, data["advantages"],
                                  result.response_mask, is_weights=result.weights,
                                  loss_agg_mode=agg, **CLIP)
    loss.backward()
    assert log_prob.grad is not None
    return loss.detach(), log_prob.grad, result


@pytest.mark.parametrize("name", CASES)
def test_matches_verl_rollout_correction(name: str) -> None:
    data, settings, agg = _case(name)
    mask = data["response_mask"]
    valid = mask > 0
    zero = torch.zeros_like(mask)
    loss, grad, result = _our_loss(data, settings, agg)
    if result is not None:
        assert torch.equal(result.response_mask, _ref(name, "mask_after"))
        if settings.is_level != "none":
            torch.testing.assert_close(torch.where(valid, result.weights, zero),
                                       torch.where(valid, _ref(name, "weights"), zero), **TOL)
        else:
            assert torch.equal(result.weights, torch.ones_like(mask))
        for key in ("kl", "k3_kl"):
            assert result.metrics[f"correction_{key}"] == pytest.approx(
                float(_ref(name, key)), rel=1e-6, abs=1e-6)
    expected = float(_ref(name, "pg_loss"))
    if math.isnan(expected):
        # verl's seq-mean aggregations multiply the mask in: NaN on padding, or a batch whose
        # every token was rejected (0/0), make its loss NaN. This project's aggregation reads
        # masked values through torch.where and gives 0 for an empty batch
        # (workers.trainer.aggregation): its loss is that of the same batch with clean
        # padding.
        current = (compute_correction(data["log_prob"], data["rollout_log_prob"], mask,
                                      settings) if result is None else result)
        emptied = not bool(current.response_mask.any())
        assert (emptied or agg.startswith("seq-mean")) and math.isfinite(float(loss))
        clean = {k: torch.where(valid, v, zero) if k.endswith("log_prob") else v
                 for k, v in data.items()}
        clean_loss, clean_grad, _ = _our_loss(clean, settings, agg)
        assert torch.equal(loss, clean_loss)
        assert torch.equal(torch.where(valid, grad, zero), torch.where(valid, clean_grad, zero))
        return
    assert float(loss) == pytest.approx(expected, rel=1e-6, abs=1e-6)
    torch.testing.assert_close(torch.where(valid, grad, zero),
                               torch.where(valid, _ref(name, "grad"), zero), **TOL)


def test_reference_exercises_every_mode() -> None:
    """The stored cases cap, zero (IcePop), normalise and reject with every rule, in both
    modes, and hold NaN/-inf padding and log-ratios beyond the safety bound (a reference where
    nothing happens would pass anything)."""
    seen_modes: set[str] = set()
    clipped = normalised = 0
    for name in CASES:
        data, settings, _ = _case(name)
        if settings.mode == "bypass":
            continue
        result = compute_correction(data["old_log_prob"], data["rollout_log_prob"],
                                    data["response_mask"], settings)
        clipped += result.metrics["correction_clipped_frac"] > 0
        normalised += result.metrics.get("correction_is_batch_norm_factor", 1.0) != 1.0
        if len(settings.rejection) == 1:
            rejected = result.metrics["correction_rejected_frac"]
            if 0 < rejected < 1:
                seen_modes.add(settings.rejection[0].mode)
    assert seen_modes == set(STORED_MODES)
    assert clipped >= 10 and normalised >= 6
    assert {str(CorrectionConfig.model_validate(json.loads(str(REFERENCE[f"{n}/settings"]))[
        "correction"]).loss_type) for n in CASES} == {"ppo_clip", "reinforce"}
    nan_set = [k for k in REFERENCE.files if k.endswith("/old_log_prob")
               and bool(np.isnan(REFERENCE[k]).any())]
    assert nan_set and any(bool(np.isneginf(REFERENCE[k]).any()) for k in nan_set)
    far = [k for k in REFERENCE.files if k.endswith("/old_log_prob") and k.startswith("inputs")
           and bool(np.nanmax(np.abs(REFERENCE[k] - REFERENCE[k.replace(
               "old_log_prob", "rollout_log_prob")])) > 20)]
    assert far


def test_every_configurable_name_is_registered() -> None:
    """The run config's names and the trainer's registries are the same lists."""
    fields = CorrectionConfig.model_fields
    assert set(IS_LEVELS.names()) == set(get_args(fields["is_level"].annotation))
    assert set(BYPASS_LOSSES.names()) == set(get_args(fields["loss_type"].annotation))
    assert set(REJECTION_MODES.names()) == set(STORED_MODES)


# --- the plain-loop reference -------------------------------------------------------------

def _random_settings(rng: random.Random) -> dict[str, Any]:
    level = rng.choice(["none", "token", "sequence"])
    settings: dict[str, Any] = {"is_level": level, "is_threshold": rng.choice([1.0, 1.3, 2.0])}
    if level != "none":
        if rng.random() < 0.4:
            settings["is_threshold_lower"] = rng.choice([0.5, 0.8, 1.0])
        settings["is_batch_normalize"] = rng.random() < 0.4
    modes = rng.sample(list(STORED_MODES), rng.randint(0, 3))
    rules = []
    for mode in modes:
        if mode.endswith("k1"):
            rules.append({"mode": mode, "upper": rng.choice([1.02, 1.3, 2.0]),
                          "lower": rng.choice([0.7, 0.95, None])})
        else:
            rules.append({"mode": mode, "upper": rng.choice([0.005, 0.05, 0.5])})
    settings["rejection"] = [{k: v for k, v in r.items() if v is not None} for r in rules]
    return settings


@pytest.mark.parametrize("seed", range(12))
def test_equals_the_plain_loop(seed: int) -> None:
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    bs, length = rng.randint(1, 7), rng.randint(1, 9)
    mask = (torch.rand((bs, length), generator=generator) > 0.25).float()
    rollout = -torch.rand((bs, length), generator=generator) * 3 - 0.01
    old = rollout + torch.randn((bs, length), generator=generator) * rng.choice([0.02, 0.3, 2])
    if bs > 1:
        rollout[-1] = 0.0  # a row without rollout log-probs
    padding = torch.where(torch.rand((bs, length), generator=generator) > 0.5, math.nan,
                          -math.inf)
    old = torch.where(mask > 0, old, padding)
    config = CorrectionConfig.model_validate(_random_settings(rng))
    result = compute_correction(old, rollout, mask, config)
    corrected = has_rollout_log_probs(rollout, mask).tolist()
    weights, kept, metrics = loop_correction(old.tolist(), rollout.tolist(), mask.tolist(),
                                             config.model_dump(), corrected)
    torch.testing.assert_close(result.weights, torch.tensor(weights), rtol=1e-5, atol=1e-6)
    assert result.response_mask.tolist() == kept
    for key, value in metrics.items():
        assert result.metrics[f"correction_{key}"] == pytest.approx(value, rel=1e-5, abs=1e-6)


# --- behaviour ---------------------------------------------------------------------------

ZERO_STALENESS_SETTINGS = [
    {"is_level": "none"},
    {"is_level": "token", "is_threshold": 1.0},
    {"is_level": "sequence", "is_threshold": 1.0},
    {"is_level": "token", "is_threshold": 1.0, "is_threshold_lower": 1.0,
     "is_batch_normalize": True},
    {"is_level": "sequence", "is_threshold": 1.0, "is_batch_normalize": True},
    {"is_level": "none", "rejection": [{"mode": m, "upper": 1.0 if m.endswith("k1") else 1e-9}
                                       for m in STORED_MODES]},
]


@pytest.mark.parametrize("settings", ZERO_STALENESS_SETTINGS)
def test_zero_staleness_is_identity(settings: dict[str, Any]) -> None:
    """The tightest settings allowed change nothing when the trainer agrees with the engine."""
    generator = torch.Generator().manual_seed(3)
    mask = (torch.rand((5, 7), generator=generator) > 0.3).float()
    log_probs = (-torch.rand((5, 7), generator=generator) * 4 - 0.01) * mask
    config = CorrectionConfig.model_validate(settings)
    result = compute_correction(log_probs, log_probs.clone(), mask, config)
    assert torch.equal(result.weights, torch.ones_like(mask))
    assert torch.equal(result.response_mask, mask)
    assert result.metrics["correction_ratio_mean"] == 1.0
    assert result.metrics["correction_kl"] == 0.0
    assert result.metrics["correction_k3_kl"] == 0.0
    assert result.metrics["correction_clipped_frac"] == 0.0
    assert result.metrics["correction_rejected_frac"] == 0.0

    advantages = torch.randn((5, 7), generator=generator)
    new = log_probs + 0.1 * torch.randn((5, 7), generator=generator)
    plain, _ = ppo_policy_loss(log_probs, new, advantages, mask)
    corrected, _ = ppo_policy_loss(log_probs, new, advantages, result.response_mask,
                                   is_weights=result.weights)
    assert torch.equal(plain, corrected)
    # Bypass mode at its first pass (current policy = trainer's = engine's) is plain PPO too.
    on_policy, _ = ppo_policy_loss(log_probs, log_probs.clone(), advantages, mask)
    bypass, _ = bypass_policy_loss(log_probs, log_probs.clone(), advantages, mask,
                                   CorrectionConfig(mode="bypass", is_level="none",
                                                    rejection=config.rejection))
    assert torch.equal(on_policy, bypass)


def test_nan_and_inf_on_padding_change_nothing() -> None:
    """verl reads masked values through torch.where: a NaN or -inf old log-prob on padding
    leaves the row's sequence weight, the rejection and the KL metrics as they were."""
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    rollout = torch.tensor([[-1.0, -0.5, 0.0, 0.0], [-2.0, -0.1, -0.3, 0.0]])
    old = torch.tensor([[-1.2, -0.4, 0.0, 0.0], [-1.7, -0.1, -0.6, 0.0]])
    dirty = old.clone()
    dirty[0, 2:] = math.nan
    dirty[1, 3] = -math.inf
    rollout_dirty = rollout.clone()
    rollout_dirty[0, 3] = math.nan
    for settings in ({"is_level": "sequence", "rejection": [
            {"mode": "seq_sum_k3", "upper": 0.5}, {"mode": "seq_max_k2", "upper": 0.5}]},
            {"is_level": "token", "is_batch_normalize": True}):
        config = CorrectionConfig.model_validate(settings)
        clean = compute_correction(old, rollout, mask, config)
        got = compute_correction(dirty, rollout_dirty, mask, config)
        assert torch.equal(got.weights, clean.weights)
        assert torch.equal(got.response_mask, clean.response_mask)
        assert got.metrics == clean.metrics
        assert all(math.isfinite(v) for v in got.metrics.values())


def test_k3_metric_is_not_clamped() -> None:
    """As verl's: exp(r) - r - 1 on the raw log-ratio, so a token 30 nats off counts as
    exp(30) - 31 (the IS weights and ratio statistics are clamped at 20)."""
    mask = torch.ones((1, 2))
    rollout = torch.tensor([[-31.0, -1.0]])
    old = torch.tensor([[-1.0, -1.0]])
    result = compute_correction(old, rollout, mask, CorrectionConfig())
    assert result.metrics["correction_k3_kl"] == pytest.approx((math.exp(30) - 31) / 2,
                                                               rel=1e-6)
    assert result.metrics["correction_ratio_max"] == pytest.approx(math.exp(20), rel=1e-6)


def test_rows_without_rollout_log_probs_are_uncorrected_and_counted() -> None:
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    old = torch.tensor([[-0.1, -0.2, -0.3], [-2.0, -3.0, 0.0], [0.0, 0.0, 0.0]])
    rollout = torch.tensor([[-3.0, -3.0, -3.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert has_rollout_log_probs(rollout, mask).tolist() == [True, False, False]
    settings = CorrectionConfig(is_level="token", is_threshold=2.0, rejection=[
        {"mode": "token_k1", "upper": 100.0}])
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


def test_sequence_rules_drop_whole_rows_and_the_max_vetoes() -> None:
    mask = torch.ones((2, 4))
    rollout = torch.full((2, 4), -1.0)
    old = rollout.clone()
    old[1, 0] = -3.0  # one token far less likely under the training policy
    rows = compute_correction(old, rollout, mask, CorrectionConfig(
        is_level="none", rejection="sequence", rejection_upper=2.0))
    assert rows.response_mask.tolist() == [[1.0] * 4, [0.0] * 4]
    assert rows.metrics["correction_rejected_frac"] == 0.5
    token = compute_correction(old, rollout, mask, CorrectionConfig(
        is_level="none", rejection="token", rejection_upper=2.0))
    assert token.response_mask.tolist() == [[1.0] * 4, [0.0, 1.0, 1.0, 1.0]]
    # The geometric mean (seq_mean_k1) of row 1 is exp(-0.5), inside a band of 2: kept; the
    # sequence max of k2 (0.5 * 2**2 = 2) vetoes it.
    geo = compute_correction(old, rollout, mask, CorrectionConfig(
        is_level="none", rejection=[{"mode": "seq_mean_k1", "upper": 2.0}]))
    assert geo.response_mask.tolist() == [[1.0] * 4] * 2
    veto = compute_correction(old, rollout, mask, CorrectionConfig(
        is_level="none", rejection=[{"mode": "seq_mean_k1", "upper": 2.0},
                                    {"mode": "seq_max_k2", "upper": 1.0}]))
    assert veto.response_mask.tolist() == [[1.0] * 4, [0.0] * 4]


def test_icepop_zeroes_weights_outside_the_band() -> None:
    mask = torch.ones((1, 3))
    rollout = torch.tensor([[-1.0, -1.0, -1.0]])
    old = torch.tensor([[-1.0, -0.2, -2.0]])  # ratios 1, e^0.8 (2.2), e^-1 (0.37)
    result = compute_correction(old, rollout, mask, CorrectionConfig(
        is_threshold=2.0, is_threshold_lower=0.5))
    assert result.weights.tolist() == [[1.0, 0.0, 0.0]]
    assert torch.equal(result.response_mask, mask)  # IcePop weights, never masks
    assert result.metrics["correction_clipped_frac"] == pytest.approx(2 / 3)


# --- the run's settings ------------------------------------------------------------------

@pytest.mark.parametrize(("value", "field"), [
    ({"is_level": "tokens"}, ("is_level",)),
    ({"is_threshold": 0.5}, ("is_threshold",)),
    ({"is_threshold": math.inf}, ("is_threshold",)),
    ({"is_threshold_lower": 1.5}, ("is_threshold_lower",)),
    ({"is_threshold_lower": 0.0}, ("is_threshold_lower",)),
    ({"rejection": "batch"}, ("rejection",)),
    ({"rejection": "token", "rejection_upper": 0.9}, ("rejection_upper",)),
    ({"rejection": "token", "rejection_lower": 1.5}, ("rejection_lower",)),
    ({"rejection": [{"mode": "seq_max_k1", "upper": 2}]}, ("rejection", 0, "mode")),
    ({"rejection": [{"mode": "token_k1", "upper": 0.5}]}, ("rejection", 0, "upper")),
    ({"rejection": [{"mode": "token_k3", "upper": 0.0}]}, ("rejection", 0, "upper")),
    ({"rejection": [{"mode": "token_k3", "upper": 1.0, "lower": 0.5}]},
     ("rejection", 0, "lower")),
    ({"rejection": [{"mode": "token_k2", "upper": 1.0}, {"mode": "token_k2", "upper": 2.0}]},
     ("rejection", 1, "mode")),
    ({"rejection": [{"mode": "token_k2", "upper": 1.0}], "rejection_upper": 3.0},
     ("rejection_upper",)),
    ({"mode": "sideways"}, ("mode",)),
    ({"loss_type": "reinforce"}, ("loss_type",)),
    ({"mode": "bypass"}, ("is_level",)),
    ({"is_level": "none", "is_threshold_lower": 0.5}, ("is_threshold_lower",)),
    ({"is_level": "none", "is_batch_normalize": True}, ("is_batch_normalize",)),
])
def test_run_config_refuses_out_of_range_and_conflicting_correction(
        value: dict[str, Any], field: tuple[Any, ...]) -> None:
    with pytest.raises(ValidationError) as info:
        RunConfig.model_validate({"correction": value})
    assert [error["loc"] for error in info.value.errors()] == [("correction", *field)]


def test_default_correction_is_decoupled_token_tis_2() -> None:
    config = RunConfig().correction
    assert config == CorrectionConfig(mode="decoupled", is_level="token", is_threshold=2.0,
                                      rejection=())


def test_older_rejection_form_reads_as_one_k1_rule() -> None:
    """Runs created before rejection rules stored ``rejection`` as a string with one band."""
    stored = {"is_level": "token", "is_threshold": 2.0, "rejection": "sequence",
              "rejection_upper": 4.0, "rejection_lower": None}
    config = CorrectionConfig.model_validate(stored)
    assert [r.model_dump() for r in config.rejection] == [
        {"mode": "seq_sum_k1", "upper": 4.0, "lower": None}]
    assert config.rejection[0].band == (0.25, 4.0)
    none = CorrectionConfig.model_validate({"rejection": "none", "rejection_upper": 2.0})
    assert none.rejection == ()
