"""Generate verl reference vectors for the trainer's math (``verl_reference.npz`` beside this file).

The test suite compares ``workers.trainer`` against these stored outputs of verl itself, so it
does not need verl installed. Produced with **verl 0.9.1** (``verl.trainer.ppo.core_algos`` and
``verl.utils.torch_functional``) and torch on CPU, float32.

What is stored (keys are ``<case>/<field>``):

- ``grpo<k>``: token-level rewards, response mask, string uids, and verl's
  ``compute_grpo_outcome_advantage`` with and without std normalisation. Batches mix group sizes
  1..8 (singletons included), groups whose rewards are all equal, right padding in the mask,
  negative samples with reward -1 appended to some groups, binary and continuous rewards.
- ``ppo<k>``: old/new log-probs (some log-ratios beyond +-20), advantages of both signs and
  zero, a mask with padding and one empty row, and for every loss_agg_mode verl's
  ``compute_policy_loss_vanilla`` loss, its three metrics and d(loss)/d(log_prob).
- ``agg``: a loss matrix and mask, ``agg_loss`` for every mode, locally and with global batch
  information (dp_size, batch_num_tokens, global_batch_size, loss_scale_factor).
- ``kl``: log-prob pairs (some differences beyond +-20) and ``kl_penalty`` for every kind,
  with and without the ``+`` straight-through suffix, values and d(sum)/d(log_prob).
- ``logits``: small logits, targets and a temperature, with verl's log-probs
  (``logprobs_from_logits_naive``) and ``entropy_from_logits`` of the scaled logits.

Equal-reward groups use exactly representable rewards (0, 1, -1, 0.5): for those verl's float32
group mean is exact and the advantage is exactly 0 (see ``test_trainer_verl_reference.py`` for
the non-representable case, where this project deliberately differs).

To regenerate (CPU only; keep verl out of the project's own environment)::

    python3 -m venv --system-site-packages /path/to/verlenv
    /path/to/verlenv/bin/pip install --no-deps verl==0.9.1
    /path/to/verlenv/bin/pip install ray "tensordict<=0.10" omegaconf codetiming
    /path/to/verlenv/bin/python tests/trainer/reference/make_verl_reference.py

The output is deterministic for a given verl/torch/numpy version (seeded generators).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import verl
from omegaconf import OmegaConf
from verl.trainer.ppo import core_algos
from verl.utils import torch_functional as verl_f

OUTPUT = Path(__file__).with_name("verl_reference.npz")
AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
KL_KINDS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl", "k1+", "abs+", "k2+", "k3+")
REPRESENTABLE = np.array([0.0, 1.0, -1.0, 0.5], dtype=np.float32)


def grpo_case(rng: np.random.Generator, *, groups: int, length: int) -> dict[str, np.ndarray]:
    rows_rewards: list[float] = []
    uids: list[str] = []
    for g in range(groups):
        uid = f"task-{rng.integers(1 << 30):08x}-{g}"
        size = int(rng.choice([1, 1, 2, 3, 4, 5, 8]))
        style = rng.integers(3)
        if style == 0:
            rewards = rng.integers(0, 2, size=size).astype(np.float32)
        elif style == 1:
            rewards = rng.normal(size=size).astype(np.float32)
        else:
            rewards = np.full(size, rng.choice(REPRESENTABLE), dtype=np.float32)
        if rng.random() < 0.3:
            rewards = np.append(rewards, np.float32(-1.0))
        rows_rewards.extend(rewards.tolist())
        uids.extend([uid] * len(rewards))
    order = rng.permutation(len(uids))
    uids_arr = np.array(uids)[order]
    reward_arr = np.array(rows_rewards, dtype=np.float32)[order]
    bs = len(uids_arr)
    lengths = rng.integers(1, length + 1, size=bs)
    mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.float32)
    token_rewards = np.zeros((bs, length), dtype=np.float32)
    token_rewards[np.arange(bs), lengths - 1] = reward_arr
    out = {"token_level_rewards": token_rewards, "response_mask": mask, "index": uids_arr}
    for norm in (True, False):
        adv, ret = core_algos.compute_grpo_outcome_advantage(
            torch.from_numpy(token_rewards.copy()),
            torch.from_numpy(mask),
            uids_arr.astype(object),
            norm_adv_by_std_in_grpo=norm,
        )
        assert torch.equal(adv, ret)
        out[f"advantages_norm{int(norm)}"] = adv.numpy()
    return out


def ppo_case(rng: np.random.Generator, *, bs: int, length: int, clip: tuple[float, float, float]):
    old = rng.normal(-1.5, 1.0, size=(bs, length)).astype(np.float32)
    scale = rng.choice([0.01, 0.1, 0.5], size=(bs, 1)).astype(np.float32)
    new = old + rng.normal(size=(bs, length)).astype(np.float32) * scale
    new[0, :2] = old[0, :2] + np.array([25.0, -30.0], dtype=np.float32)  # beyond the clamp
    adv = rng.normal(size=(bs, 1)).astype(np.float32).repeat(length, axis=1)
    adv[1] = 0.0
    adv += rng.normal(size=(bs, length)).astype(np.float32) * 0.1 * (rng.random((bs, 1)) < 0.5)
    lengths = rng.integers(1, length + 1, size=bs)
    lengths[-1] = 0
    mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.float32)
    low, high, dual = clip
    out = {
        "old_log_prob": old,
        "log_prob": new,
        "advantages": adv,
        "response_mask": mask,
        "clip": np.array(clip, dtype=np.float64),
    }
    config = OmegaConf.create(
        {
            "clip_ratio": low,
            "clip_ratio_low": low,
            "clip_ratio_high": high,
            "clip_ratio_c": dual,
            "global_batch_info": {},
        }
    )
    for mode in AGG_MODES:
        log_prob = torch.from_numpy(new.copy()).requires_grad_(True)
        loss, metrics = core_algos.compute_policy_loss_vanilla(
            old_log_prob=torch.from_numpy(old),
            log_prob=log_prob,
            advantages=torch.from_numpy(adv),
            response_mask=torch.from_numpy(mask).bool(),
            loss_agg_mode=mode,
            config=config,
        )
        loss.backward()
        out[f"{mode}/loss"] = np.array(loss.item(), dtype=np.float32)
        out[f"{mode}/grad"] = log_prob.grad.numpy()
        for key in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"):
            out[f"{mode}/{key}"] = np.array(metrics[f"actor/{key}"], dtype=np.float32)
    return out


def agg_case(rng: np.random.Generator) -> dict[str, np.ndarray]:
    bs, length = 9, 13
    loss_mat = rng.normal(size=(bs, length)).astype(np.float32)
    lengths = rng.integers(0, length + 1, size=bs)
    lengths[0] = 0
    lengths[1] = length
    mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.float32)
    out = {"loss_mat": loss_mat, "mask": mask}
    global_info = {"dp_size": 4, "batch_num_tokens": 211, "global_batch_size": 29}
    for mode in AGG_MODES:
        local = core_algos.agg_loss(torch.from_numpy(loss_mat), torch.from_numpy(mask), mode)
        out[f"{mode}/local"] = np.array(local.item(), dtype=np.float32)
        scaled = core_algos.agg_loss(
            torch.from_numpy(loss_mat),
            torch.from_numpy(mask),
            mode,
            loss_scale_factor=512,
            **global_info,
        )
        out[f"{mode}/global"] = np.array(scaled.item(), dtype=np.float32)
    out["global_info"] = np.array(
        [
            global_info["dp_size"],
            global_info["batch_num_tokens"],
            global_info["global_batch_size"],
            512,
        ],
        dtype=np.int64,
    )
    return out


def kl_case(rng: np.random.Generator) -> dict[str, np.ndarray]:
    shape = (6, 11)
    log_prob = rng.normal(-2.0, 1.5, size=shape).astype(np.float32)
    ref = log_prob + rng.normal(0.0, 0.7, size=shape).astype(np.float32)
    ref[0, :3] = log_prob[0, :3] + np.array([30.0, -30.0, 12.0], dtype=np.float32)
    out = {"log_prob": log_prob, "ref_log_prob": ref}
    for kind in KL_KINDS:
        lp = torch.from_numpy(log_prob.copy()).requires_grad_(True)
        value = core_algos.kl_penalty(lp, torch.from_numpy(ref), kind)
        value.sum().backward()
        out[f"{kind}/value"] = value.detach().numpy()
        out[f"{kind}/grad"] = lp.grad.numpy()
    return out


def logits_case(rng: np.random.Generator) -> dict[str, np.ndarray]:
    logits = (rng.normal(size=(3, 7, 41)) * 3.0).astype(np.float32)
    targets = rng.integers(0, 41, size=(3, 7))
    temperature = 0.7
    scaled = torch.from_numpy(logits) / temperature
    log_probs = verl_f.logprobs_from_logits_naive(scaled, torch.from_numpy(targets))
    entropy = verl_f.entropy_from_logits(scaled)
    return {
        "logits": logits,
        "targets": targets,
        "temperature": np.array(temperature, dtype=np.float64),
        "log_probs": log_probs.numpy(),
        "entropy": entropy.numpy(),
    }


def main() -> None:
    if verl.__version__ != "0.9.1":
        sys.exit(f"expected verl 0.9.1, found {verl.__version__}")
    torch.manual_seed(0)
    rng = np.random.default_rng(20250805)
    arrays: dict[str, np.ndarray] = {"verl_version": np.array(verl.__version__)}
    cases = {
        "grpo0": grpo_case(rng, groups=12, length=9),
        "grpo1": grpo_case(rng, groups=30, length=16),
        "grpo2": grpo_case(rng, groups=5, length=4),
        "ppo0": ppo_case(rng, bs=10, length=12, clip=(0.2, 0.2, 3.0)),
        "ppo1": ppo_case(rng, bs=16, length=20, clip=(0.2, 0.28, 2.5)),
        "agg": agg_case(rng),
        "kl": kl_case(rng),
        "logits": logits_case(rng),
    }
    for case, fields in cases.items():
        for field, value in fields.items():
            arrays[f"{case}/{field}"] = value
    np.savez_compressed(OUTPUT, **arrays)
    print(f"wrote {len(arrays)} arrays to {OUTPUT}")


if __name__ == "__main__":
    main()
