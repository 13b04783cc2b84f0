"""Generate verl reference vectors for the off-policy correction (``rollout_corr_reference.npz``).

The test suite compares ``workers.trainer.correction`` (and the policy losses it feeds) against
these stored outputs of verl itself, so it does not need verl installed. Produced with
**verl 0.9.1** and torch on CPU, float32:

- decoupled mode: ``compute_rollout_correction_and_rejection_mask`` of
  ``verl.trainer.ppo.rollout_corr_helper`` (IS weights, mask after rejection, ``kl`` and
  ``k3_kl`` metrics), then ``compute_policy_loss_vanilla`` of ``verl.trainer.ppo.core_algos``
  with those weights and that mask (loss and d(loss)/d(log_prob));
- bypass mode: ``compute_policy_loss_bypass_mode`` (``ppo_clip`` and ``reinforce``), loss and
  gradient.

Settings cover every ``rollout_is`` level with a cap (TIS) and with a ``lower_upper`` threshold
(IcePop), batch-normalised weights, every ``rollout_rs`` option (token, sequence sum, sequence
mean and sequence max, with k1/k2/k3), chains of several options, and both bypass loss types.
Inputs: trainer and rollout log-probs with right padding and an empty row; one set with
log-ratios beyond verl's +-20 safety bound; one with NaN and -inf on the padding of the
trainer's and the rollout's log-probs (verl reads masked values through ``torch.where``).

Keys: ``inputs<k>/<field>`` hold input set k (``old_log_prob``, ``rollout_log_prob``,
``response_mask``, ``advantages``, ``log_prob``); ``<case>/<field>`` hold verl's outputs for a
case, ``<case>/inputs`` its input set and ``<case>/settings`` the JSON of its
``RunConfig.correction`` (and ``loss_agg_mode``); ``cases`` lists the case names.

To regenerate (CPU only; keep verl out of the project's own environment)::

    python3 -m venv /path/to/verlenv
    /path/to/verlenv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    /path/to/verlenv/bin/pip install --no-deps verl==0.9.1
    /path/to/verlenv/bin/pip install numpy ray "tensordict<=0.10" omegaconf codetiming \\
        transformers
    /path/to/verlenv/bin/python tests/trainer/reference/make_rollout_corr_reference.py

The output is deterministic for a given verl/torch version (seeded generator).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import verl
from omegaconf import OmegaConf
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

OUTPUT = Path(__file__).with_name("rollout_corr_reference.npz")
CLIP = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}


def rule(mode: str, upper: float, lower: float | None = None) -> dict[str, Any]:
    return {"mode": mode, "upper": upper, **({} if lower is None else {"lower": lower})}


#: (name, RunConfig.correction, loss_agg_mode)
SETTINGS: tuple[tuple[str, dict[str, Any], str], ...] = (
    ("tis_token_2", {"is_level": "token", "is_threshold": 2.0}, "token-mean"),
    ("tis_token_1.5", {"is_level": "token", "is_threshold": 1.5}, "token-mean"),
    ("tis_sequence_2", {"is_level": "sequence", "is_threshold": 2.0}, "token-mean"),
    ("tis_sequence_5", {"is_level": "sequence", "is_threshold": 5.0}, "seq-mean-token-mean"),
    ("icepop_token", {"is_level": "token", "is_threshold": 1.5, "is_threshold_lower": 0.8},
     "token-mean"),
    ("icepop_sequence", {"is_level": "sequence", "is_threshold": 3.0,
                         "is_threshold_lower": 0.5}, "token-mean"),
    ("tis_token_batchnorm", {"is_level": "token", "is_threshold": 2.0,
                             "is_batch_normalize": True}, "token-mean"),
    ("tis_sequence_batchnorm", {"is_level": "sequence", "is_threshold": 4.0,
                                "is_batch_normalize": True}, "token-mean"),
    ("icepop_token_batchnorm", {"is_level": "token", "is_threshold": 2.0,
                                "is_threshold_lower": 0.7, "is_batch_normalize": True},
     "token-mean"),
    ("rs_token_k1", {"is_level": "none", "rejection": [rule("token_k1", 2.0, 0.5)]},
     "token-mean"),
    ("rs_token_k1_asym", {"is_level": "none", "rejection": [rule("token_k1", 1.5, 0.8)]},
     "token-mean"),
    ("rs_token_k2", {"is_level": "none", "rejection": [rule("token_k2", 0.02)]}, "token-mean"),
    ("rs_token_k3", {"is_level": "none", "rejection": [rule("token_k3", 0.02)]}, "token-mean"),
    ("rs_seq_sum_k1", {"is_level": "none", "rejection": [rule("seq_sum_k1", 2.0, 0.5)]},
     "token-mean"),
    ("rs_seq_sum_k2", {"is_level": "none", "rejection": [rule("seq_sum_k2", 0.05)]},
     "token-mean"),
    ("rs_seq_sum_k3", {"is_level": "none", "rejection": [rule("seq_sum_k3", 0.05)]},
     "token-mean"),
    ("rs_seq_mean_k1", {"is_level": "none", "rejection": [rule("seq_mean_k1", 1.05, 0.95)]},
     "token-mean"),
    ("rs_seq_mean_k2", {"is_level": "none", "rejection": [rule("seq_mean_k2", 0.01)]},
     "token-mean"),
    ("rs_seq_mean_k3", {"is_level": "none", "rejection": [rule("seq_mean_k3", 0.01)]},
     "token-mean"),
    ("rs_seq_max_k2", {"is_level": "none", "rejection": [rule("seq_max_k2", 0.05)]},
     "token-mean"),
    ("rs_seq_max_k3", {"is_level": "none", "rejection": [rule("seq_max_k3", 0.05)]},
     "token-mean"),
    ("tis_token_rs_seq_sum_k1", {"is_level": "token", "is_threshold": 2.0,
                                 "rejection": [rule("seq_sum_k1", 4.0, 0.25)]}, "token-mean"),
    ("tis_sequence_rs_token_k1", {"is_level": "sequence", "is_threshold": 3.0,
                                  "rejection": [rule("token_k1", 2.0, 0.5)]}, "token-mean"),
    ("chain_token_k1_seq_max_k3", {"is_level": "token", "is_threshold": 2.0, "rejection": [
        rule("token_k1", 1.5, 0.7), rule("seq_max_k3", 0.1)]}, "token-mean"),
    ("chain_geo_k3_token_k2", {"is_level": "sequence", "is_threshold": 2.0, "rejection": [
        rule("seq_mean_k1", 1.02, 0.98), rule("seq_sum_k3", 0.2), rule("token_k2", 0.05)]},
     "seq-mean-token-sum"),
    ("bypass_ppo_clip", {"mode": "bypass", "is_level": "none"}, "token-mean"),
    ("bypass_ppo_clip_geo_rs", {"mode": "bypass", "is_level": "none",
                                "rejection": [rule("seq_mean_k1", 1.02, 0.98)]}, "token-mean"),
    ("bypass_ppo_clip_k3_rs", {"mode": "bypass", "is_level": "none",
                               "rejection": [rule("token_k3", 0.02)]}, "token-mean"),
    ("bypass_reinforce", {"mode": "bypass", "loss_type": "reinforce", "is_level": "none"},
     "seq-mean-token-sum"),
    ("bypass_reinforce_seq_tis", {"mode": "bypass", "loss_type": "reinforce",
                                  "is_level": "sequence", "is_threshold": 2.0},
     "seq-mean-token-sum"),
    ("bypass_reinforce_token_tis_geo_rs", {
        "mode": "bypass", "loss_type": "reinforce", "is_level": "token", "is_threshold": 2.0,
        "rejection": [rule("seq_mean_k1", 1.05, 0.95)]}, "token-mean"),
    ("bypass_reinforce_icepop_batchnorm", {
        "mode": "bypass", "loss_type": "reinforce", "is_level": "token", "is_threshold": 1.5,
        "is_threshold_lower": 0.7, "is_batch_normalize": True}, "token-mean"),
)


def verl_arguments(settings: dict[str, Any]) -> dict[str, Any]:
    """verl's ``rollout_is``/``rollout_rs`` arguments for a ``RunConfig.correction``."""
    level = settings.get("is_level", "token")
    cap = settings.get("is_threshold", 2.0)
    lower = settings.get("is_threshold_lower")
    rules = settings.get("rejection", [])
    return {
        "rollout_is": None if level == "none" else level,
        "rollout_is_threshold": cap if lower is None else f"{lower}_{cap}",
        "rollout_is_batch_normalize": settings.get("is_batch_normalize", False),
        "rollout_rs": ",".join(r["mode"] for r in rules) or None,
        "rollout_rs_threshold": ",".join(
            f"{r['lower']}_{r['upper']}" if r["mode"].endswith("k1") else f"{r['upper']}"
            for r in rules) or None,
    }


def inputs(generator: torch.Generator, *, bs: int, length: int, spread: float,
           far: bool = False, nan_padding: bool = False) -> dict[str, torch.Tensor]:
    rollout = -torch.rand((bs, length), generator=generator) * 3.0 - 0.01
    shift = torch.randn((bs, length), generator=generator) * spread
    old = (rollout + shift).clamp(max=0.0)
    if far:  # log-ratios beyond the +-20 safety bound
        old[0, :3] = rollout[0, :3] + torch.tensor([25.0, -30.0, 21.0])
    lengths = torch.randint(2, length + 1, (bs,), generator=generator)
    lengths[1] = 0  # an empty row
    lengths[2] = length  # a full row
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).float()
    advantages = torch.randn((bs, length), generator=generator) * mask
    new = old + torch.randn((bs, length), generator=generator) * 0.1
    old, rollout = old * mask, rollout * mask
    if nan_padding:  # NaN on the padding of even rows, -inf on odd ones
        odd = (torch.arange(bs) % 2 == 1).unsqueeze(1).expand_as(mask)
        filler = torch.where(odd, torch.full_like(old, -math.inf), torch.full_like(old, math.nan))
        old = torch.where(mask == 0, filler, old)
        rollout = torch.where(mask == 0, torch.full_like(rollout, math.nan), rollout)
    return {"old_log_prob": old, "rollout_log_prob": rollout, "response_mask": mask,
            "advantages": advantages, "log_prob": new}


def verl_case(data: dict[str, torch.Tensor], settings: dict[str, Any], agg: str
              ) -> dict[str, np.ndarray]:
    args = verl_arguments(settings)
    mask = data["response_mask"]
    log_prob = data["log_prob"].clone().requires_grad_(True)
    out: dict[str, np.ndarray] = {}
    if settings.get("mode", "decoupled") == "bypass":
        config = OmegaConf.create({**CLIP, "global_batch_info": {}, "policy_loss": {
            "rollout_correction": {**args, "loss_type": settings.get("loss_type", "ppo_clip")}}})
        loss, _ = core_algos.compute_policy_loss_bypass_mode(
            old_log_prob=data["rollout_log_prob"], log_prob=log_prob,
            advantages=data["advantages"], response_mask=mask, loss_agg_mode=agg,
            config=config)
    else:
        proto, mask_after, metrics = compute_rollout_correction_and_rejection_mask(
            old_log_prob=data["old_log_prob"], rollout_log_prob=data["rollout_log_prob"],
            response_mask=mask, **args)
        weights = proto.batch["rollout_is_weights"] if proto is not None else None
        config = OmegaConf.create({**CLIP, "global_batch_info": {}})
        loss, _ = core_algos.compute_policy_loss_vanilla(
            old_log_prob=data["old_log_prob"], log_prob=log_prob,
            advantages=data["advantages"], response_mask=mask_after, loss_agg_mode=agg,
            config=config, rollout_is_weights=weights)
        out["mask_after"] = mask_after.float().numpy()
        if weights is not None:
            out["weights"] = weights.numpy()
        out["kl"] = np.array(metrics["rollout_corr/kl"], dtype=np.float64)
        out["k3_kl"] = np.array(metrics["rollout_corr/k3_kl"], dtype=np.float64)
    loss.backward()
    out["pg_loss"] = np.array(loss.item(), dtype=np.float64)
    assert log_prob.grad is not None
    out["grad"] = log_prob.grad.numpy()
    return out


def main() -> None:
    if verl.__version__ != "0.9.1":
        raise SystemExit(f"expected verl 0.9.1, found {verl.__version__}")
    generator = torch.Generator().manual_seed(21)
    input_sets = [inputs(generator, bs=6, length=9, spread=spread)
                  for spread in (0.05, 0.3, 0.8)]
    input_sets.append(inputs(generator, bs=6, length=11, spread=0.3, far=True))
    input_sets.append(inputs(generator, bs=7, length=10, spread=0.3, nan_padding=True))
    arrays: dict[str, np.ndarray] = {"verl_version": np.array(verl.__version__),
                                     "torch_version": np.array(torch.__version__)}
    names: list[str] = []
    for index, data in enumerate(input_sets):
        for name, settings, agg in SETTINGS:
            case = f"{name}/{index}"
            names.append(case)
            arrays[f"{case}/inputs"] = np.array(index)
            arrays[f"{case}/settings"] = np.array(json.dumps(
                {"correction": settings, "loss_agg_mode": agg}))
            for field, value in verl_case(data, settings, agg).items():
                arrays[f"{case}/{field}"] = value
    for index, data in enumerate(input_sets):
        for field, value in data.items():
            arrays[f"inputs{index}/{field}"] = value.numpy()
    arrays["cases"] = np.array(names)
    np.savez_compressed(OUTPUT, **arrays)
    print(f"wrote {len(names)} cases ({len(arrays)} arrays) to {OUTPUT}")


if __name__ == "__main__":
    main()
