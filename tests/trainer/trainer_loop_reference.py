"""Plain-loop references for the trainer's vectorised functions.

Each function here states the rule one sample (or one token) at a time in plain Python, the way
the rule is written in verl or in the EGPO paper, and is compared with the vectorised code by
seeded equivalence tests. Values are Python floats; slow but obvious.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import torch

__all__ = [
    "loop_agg_loss",
    "loop_correction",
    "loop_cot_mask",
    "loop_egpo_advantages",
    "loop_grpo_scalars",
    "loop_rollout_grpo_scalars",
    "loop_kl",
    "loop_ppo_token_losses",
    "naive_logprobs_entropy",
]


def loop_grpo_scalars(
    scores: Sequence[float], index: Sequence[object], *, norm_adv_by_std: bool, epsilon: float
) -> list[float]:
    """verl's GRPO per response: group by uid, mean and unbiased std, singleton -> (0, 1)."""
    groups: dict[object, list[float]] = defaultdict(list)
    for score, uid in zip(scores, index, strict=True):
        groups[uid].append(score)
    stats: dict[object, tuple[float, float]] = {}
    for uid, values in groups.items():
        if len(values) == 1:
            stats[uid] = (0.0, 1.0)
        else:
            mean = sum(values) / len(values)
            var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
            stats[uid] = (mean, math.sqrt(var))
    out = []
    for score, uid in zip(scores, index, strict=True):
        mean, std = stats[uid]
        out.append((score - mean) / (std + epsilon) if norm_adv_by_std else score - mean)
    return out


def loop_rollout_grpo_scalars(
    scores: Sequence[float], index: Sequence[object], units: Sequence[object], *,
    norm_adv_by_std: bool, epsilon: float
) -> list[float]:
    """Rollout-level GRPO: average each unit's scores into one score, run GRPO over the units
    of each group (each unit once), give every response its unit's advantage."""
    members: dict[object, list[float]] = defaultdict(list)
    unit_group: dict[object, object] = {}
    for score, uid, unit in zip(scores, index, units, strict=True):
        members[unit].append(score)
        unit_group[unit] = uid
    unit_ids = list(members)
    unit_scores = [sum(members[u]) / len(members[u]) for u in unit_ids]
    per_unit = loop_grpo_scalars(unit_scores, [unit_group[u] for u in unit_ids],
                                 norm_adv_by_std=norm_adv_by_std, epsilon=epsilon)
    by_unit = dict(zip(unit_ids, per_unit, strict=True))
    return [by_unit[unit] for unit in units]


def loop_cot_mask(
    responses: list[list[int]], mask: list[list[int]], *, start: int, end: int
) -> list[list[bool]]:
    """Walk each row: markers toggle the state; before the first marker a row is inside a block
    only if that first marker is a closing one; CoT = inside, not a marker, in the mask."""
    out = []
    for row, row_mask in zip(responses, mask, strict=True):
        first = next((tok for tok in row if tok in (start, end)), None)
        inside = first == end
        flags = []
        for tok, keep in zip(row, row_mask, strict=True):
            if tok == start:
                inside = True
                flags.append(False)
            elif tok == end:
                inside = False
                flags.append(False)
            else:
                flags.append(inside and keep != 0)
        out.append(flags)
    return out


def loop_egpo_advantages(
    scalars: Sequence[float],
    entropies: list[list[float]],
    cot: list[list[bool]],
    *,
    lam: float,
    alpha: float,
    variant: str,
) -> list[float]:
    """EGPO per response: H = mean CoT entropy; no CoT or A == 0 -> no bonus."""
    out = []
    for a, row_entropy, row_cot in zip(scalars, entropies, cot, strict=True):
        values = [h for h, c in zip(row_entropy, row_cot, strict=True) if c]
        if not values or a == 0:
            out.append(a)
            continue
        h = max(sum(values) / len(values), 0.0)
        bound = abs(a) / alpha
        if variant == "clip":
            bonus = lam * min(max(h, -bound), bound)
        elif variant == "paper":
            bonus = min(lam * h, bound)
        else:
            raise ValueError(variant)
        out.append(a + bonus)
    return out


def loop_agg_loss(
    loss_mat: list[list[float]],
    mask: list[list[float]],
    mode: str,
    *,
    dp_size: int = 1,
    batch_num_tokens: int | None = None,
    global_batch_size: int | None = None,
    loss_scale_factor: float | None = None,
) -> float:
    """verl's agg_loss written row by row (empty batches aggregate to 0)."""
    token_sum = sum(
        v * m
        for row, mrow in zip(loss_mat, mask, strict=True)
        for v, m in zip(row, mrow, strict=True)
        if m
    )
    token_count = sum(m for mrow in mask for m in mrow)
    if mode == "token-mean":
        denominator = batch_num_tokens if batch_num_tokens is not None else max(token_count, 1)
        return token_sum / denominator * dp_size
    if mode == "token-sum":
        return token_sum * dp_size
    seq_losses = []
    for row, mrow in zip(loss_mat, mask, strict=True):
        count = sum(mrow)
        if count == 0:
            continue
        total = sum(v * m for v, m in zip(row, mrow, strict=True) if m)
        seq_losses.append(total / (count + 1e-8) if mode == "seq-mean-token-mean" else total)
    denominator = global_batch_size if global_batch_size is not None else max(len(seq_losses), 1)
    loss = sum(seq_losses) / denominator * dp_size
    if mode == "seq-mean-token-sum-norm":
        loss /= loss_scale_factor if loss_scale_factor is not None else len(mask[0])
    elif mode not in ("seq-mean-token-sum", "seq-mean-token-mean"):
        raise ValueError(mode)
    return loss


def loop_ppo_token_losses(
    old: list[list[float]],
    new: list[list[float]],
    adv: list[list[float]],
    *,
    low: float,
    high: float,
    dual: float,
) -> tuple[list[list[float]], list[list[bool]], list[list[bool]]]:
    """Dual-clip PPO per token: (loss, clipped-term-larger, dual-clip-hit) as in verl."""
    losses, clipped_flags, lower_flags = [], [], []
    for o_row, n_row, a_row in zip(old, new, adv, strict=True):
        l_row, c_row, d_row = [], [], []
        for o, n, a in zip(o_row, n_row, a_row, strict=True):
            ratio = math.exp(min(max(n - o, -20.0), 20.0))
            unclipped = -a * ratio
            clipped = -a * min(max(ratio, 1 - low), 1 + high)
            loss = max(unclipped, clipped)
            hit_dual = a < 0 and loss > -a * dual
            if a < 0:
                loss = min(loss, -a * dual)
            l_row.append(loss)
            c_row.append(clipped > unclipped)
            d_row.append(hit_dual)
        losses.append(l_row)
        clipped_flags.append(c_row)
        lower_flags.append(d_row)
    return losses, clipped_flags, lower_flags


def loop_kl(log_prob: float, ref_log_prob: float, kind: str) -> float:
    """One token's KL estimate (value only; ``+`` kinds have the same value)."""
    kind = kind.rstrip("+")
    d = log_prob - ref_log_prob
    if kind in ("k1", "kl"):
        return d
    if kind == "abs":
        return abs(d)
    if kind in ("k2", "mse"):
        return 0.5 * d * d
    if kind in ("k3", "low_var_kl"):
        r = min(max(-d, -20.0), 20.0)
        return min(max(math.exp(r) - r - 1.0, -10.0), 10.0)
    raise ValueError(kind)


def naive_logprobs_entropy(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The full-tensor computation the chunked functions must equal."""
    scaled = logits.float() / temperature
    log_probs = torch.log_softmax(scaled, dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
    return log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy


def loop_correction(
    old: Sequence[Sequence[float]], rollout: Sequence[Sequence[float]],
    mask: Sequence[Sequence[float]], settings: dict, corrected: Sequence[bool]
) -> tuple[list[list[float]], list[list[float]], dict[str, float]]:
    """verl 0.9.1's rollout correction row by row and token by token: ``(weights, mask after
    rejection, {"kl", "k3_kl"})``. ``settings`` is a ``RunConfig.correction`` as a dict (its
    defaults filled in); rows outside ``corrected`` keep weight 1 and their mask."""
    bound = 20.0

    def clamp(x: float) -> float:
        return max(-bound, min(bound, x))

    rows = []  # per row: the valid positions and their log-ratios
    for i, row_mask in enumerate(mask):
        valid = [j for j, m in enumerate(row_mask) if m > 0 and corrected[i]]
        rows.append((valid, {j: old[i][j] - rollout[i][j] for j in valid}))
    level, cap = settings["is_level"], settings["is_threshold"]
    lower_is = settings["is_threshold_lower"]
    weights = [[1.0] * len(r) for r in mask]
    raw: dict[tuple[int, int], float] = {}
    for i, (valid, ratio) in enumerate(rows):
        seq = math.exp(clamp(sum(ratio.values()))) if valid else 1.0
        for j in valid:
            raw[i, j] = math.exp(clamp(ratio[j])) if level == "token" else seq
    if level != "none":
        applied = {}
        for key, w in raw.items():
            if lower_is is None:
                applied[key] = min(w, cap)
            else:
                applied[key] = w if lower_is <= w <= cap else 0.0
        if settings["is_batch_normalize"] and applied:
            if level == "token":
                mean = sum(applied.values()) / len(applied)
            else:
                firsts = {i: w for (i, _), w in sorted(applied.items())}
                mean = sum(firsts.values()) / len(firsts)
            if mean > 1e-8:
                applied = {key: w / mean for key, w in applied.items()}
        for (i, j), w in applied.items():
            weights[i][j] = w
    statistic = {"k1": lambda r: -clamp(r), "k2": lambda r: 0.5 * clamp(r) ** 2,
                 "k3": lambda r: math.exp(clamp(r)) - 1.0 - clamp(r)}
    out_mask = [list(map(float, r)) for r in mask]
    for rule in settings["rejection"]:
        level_name, kind = rule["mode"].rsplit("_", 1)
        upper = rule["upper"]
        lower = rule.get("lower") or (1.0 / upper)

        def passes(value: float, kind: str = kind, lower: float = lower,
                   upper: float = upper) -> bool:
            if kind == "k1":
                return math.log(lower) <= value <= math.log(upper)
            return value <= upper

        for i, (valid, ratio) in enumerate(rows):
            stats = [statistic[kind](ratio[j]) for j in valid]
            if level_name == "token":
                for j, value in zip(valid, stats, strict=True):
                    if not passes(value):
                        out_mask[i][j] = 0.0
                continue
            if level_name == "seq_sum":
                value = sum(stats)
            elif level_name == "seq_mean":
                value = sum(stats) / len(stats) if stats else 0.0
            else:
                value = max(stats) if stats else 0.0
            if not passes(value):
                for j in valid:
                    out_mask[i][j] = 0.0
    ratios = [ratio[j] for valid, ratio in rows for j in valid]
    metrics = {}
    if ratios:
        metrics = {"kl": -sum(ratios) / len(ratios),
                   "k3_kl": sum(math.exp(r) - r - 1.0 for r in ratios) / len(ratios)}
    return weights, out_mask, metrics
