"""Generate verl reference vectors for the off-policy correction (``rollout_corr_reference.json``).

The test suite compares ``workers.trainer.correction`` (and the IS-weighted policy loss)
against these stored outputs of verl itself, so it does not need verl installed. Produced with
**verl 0.9.1** (``compute_rollout_correction_and_rejection_mask`` of
``verl.trainer.ppo.rollout_corr_helper`` and ``compute_policy_loss_vanilla`` of
``verl.trainer.ppo.core_algos`` with ``rollout_is_weights``), torch on CPU, float32.

Each case stores the inputs (trainer log-probs, rollout log-probs, response mask with padding
and an empty row, advantages) and, for one verl setting (``rollout_is`` token/sequence with a
cap; ``rollout_rs`` token_k1/seq_sum_k1 with a ``lower_upper`` band), verl's IS weights, its
mask after rejection, its ``kl``/``k3_kl`` metrics, and the token-mean policy loss with those
weights and that mask. Log-ratios stay inside verl's +-20 safety bound.

To regenerate (CPU only; keep verl out of the project's own environment)::

    python3 -m venv --system-site-packages /path/to/verlenv
    /path/to/verlenv/bin/pip install --no-deps verl==0.9.1
    /path/to/verlenv/bin/pip install ray "tensordict<=0.10" omegaconf codetiming
    /path/to/verlenv/bin/python tests/trainer/reference/make_rollout_corr_reference.py

The output is deterministic for a given verl/torch version (seeded generator).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import verl
from omegaconf import OmegaConf
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

OUTPUT = Path(__file__).with_name("rollout_corr_reference.json")

#: (name, rollout_is, is cap, rollout_rs, rs band "lower_upper")
SETTINGS = (
    ("tis_token_2", "token", 2.0, None, None),
    ("tis_token_1.5", "token", 1.5, None, None),
    ("tis_sequence_2", "sequence", 2.0, None, None),
    ("tis_sequence_5", "sequence", 5.0, None, None),
    ("rs_token", None, None, "token_k1", (0.5, 2.0)),
    ("rs_token_asym", None, None, "token_k1", (0.8, 1.5)),
    ("rs_sequence", None, None, "seq_sum_k1", (0.5, 2.0)),
    ("tis_token_rs_sequence", "token", 2.0, "seq_sum_k1", (0.25, 4.0)),
    ("tis_sequence_rs_token", "sequence", 3.0, "token_k1", (0.5, 2.0)),
)


def _inputs(generator: torch.Generator, bs: int, length: int, spread: float
            ) -> dict[str, torch.Tensor]:
    rollout = -torch.rand((bs, length), generator=generator) * 3.0 - 0.01
    shift = torch.randn((bs, length), generator=generator) * spread
    old = (rollout + shift).clamp(max=0.0)
    lengths = torch.randint(1, length + 1, (bs,), generator=generator)
    lengths[1] = 0  # an empty row
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).float()
    advantages = torch.randn((bs, length), generator=generator) * mask
    return {"old": old * mask, "rollout": rollout * mask, "mask": mask,
            "advantages": advantages}


def main() -> None:
    generator = torch.Generator().manual_seed(21)
    config = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2,
                               "clip_ratio_c": 3.0, "global_batch_info": {}})
    cases = []
    for index, spread in enumerate((0.05, 0.3, 0.8)):
        inputs = _inputs(generator, 6, 9, spread)
        new = inputs["old"] + torch.randn(inputs["old"].shape, generator=generator) * 0.1
        new = new * inputs["mask"]
        for name, is_level, cap, rs, band in SETTINGS:
            weights_proto, mask, metrics = compute_rollout_correction_and_rejection_mask(
                old_log_prob=inputs["old"], rollout_log_prob=inputs["rollout"],
                response_mask=inputs["mask"], rollout_is=is_level, rollout_is_threshold=cap,
                rollout_rs=rs,
                rollout_rs_threshold=None if band is None else f"{band[0]}_{band[1]}")
            weights = (weights_proto.batch["rollout_is_weights"] if weights_proto is not None
                       else None)
            loss, _ = core_algos.compute_policy_loss_vanilla(
                old_log_prob=inputs["old"], log_prob=new, advantages=inputs["advantages"],
                response_mask=mask, loss_agg_mode="token-mean", config=config,
                rollout_is_weights=weights)
            cases.append({
                "name": f"{name}/{index}",
                "is_level": is_level or "none",
                "is_threshold": cap or 2.0,
                "rejection": {None: "none", "token_k1": "token",
                              "seq_sum_k1": "sequence"}[rs],
                "band": list(band) if band else None,
                "old_log_prob": inputs["old"].tolist(),
                "rollout_log_prob": inputs["rollout"].tolist(),
                "response_mask": inputs["mask"].tolist(),
                "advantages": inputs["advantages"].tolist(),
                "log_prob": new.tolist(),
                "weights": weights.tolist() if weights is not None else None,
                "mask_after": mask.float().tolist(),
                "kl": metrics["rollout_corr/kl"],
                "k3_kl": metrics["rollout_corr/k3_kl"],
                "pg_loss": float(loss),
            })
    OUTPUT.write_text(json.dumps({"verl_version": verl.__version__,
                                  "torch_version": torch.__version__, "cases": cases}) + "\n")
    print(f"wrote {len(cases)} cases to {OUTPUT}")


if __name__ == "__main__":
    main()
