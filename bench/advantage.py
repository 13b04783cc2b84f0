"""Benchmark: vectorised GRPO/EGPO against verl's per-sample loop, and chunked entropy memory.

Part 1 (speed). On a batch of ``--bs`` x ``--length`` (default 8,192 x 1,024) with string uids,
groups of ``--group-size`` plus -1 negatives, it times

- the baseline: verl's ``compute_grpo_outcome_advantage`` if verl is importable, else a copy of
  its per-sample loop written here (same operations: per-sample 0-d tensors in a dict of lists,
  ``torch.stack``/``mean``/``std`` per group, a per-sample assignment loop);
- ``workers.trainer.egpo.grpo_advantages`` (same inputs), returning a new tensor and writing
  into a reused ``out=`` buffer (what a training loop with a fixed batch shape can do);
- ``workers.trainer.egpo.egpo_advantages`` against a per-sample loop EGPO (the loop GRPO plus,
  per response, its CoT span from the marker positions, the mean CoT entropy and the clip).

Each comparison runs ``--rounds`` rounds (default 3); a round is the best-of-``--repeats`` wall
time of each side. It prints every round, then the median round times, the median speed ratio
(target >= 10x) and the max abs difference (target <= 1e-6).

Part 2 (memory). Per-token log-probs and entropies of ``--mem-bs`` x ``--mem-length`` tokens over
a ``--vocab`` vocabulary from hidden states of width ``--hidden``: the chunked function
(``logprobs_and_entropy_from_hidden``) against the naive computation (full float32 logits, then
log-softmax, softmax and the entropy sum, as verl computes them without chunking). Each
measurement runs in a fresh subprocess and reports its peak RSS (``ru_maxrss``) above the RSS
after the inputs were built. The naive computation at full size needs ~3 x 20 GB and does not
fit in memory, so it is measured at ``--naive-lengths`` and extrapolated linearly in the number
of tokens (the measured bytes per token are printed for each length to show the linearity and
are checked against the analytic count of three (tokens x vocab) float32 tensors). The output
marks every number as MEASURED or EXTRAPOLATED.

``--grad`` measures forward + backward instead (gradients of the hidden states and the head
weight; the chunked path recomputes each chunk under activation checkpointing).

Run ``python bench/advantage.py`` (about ten minutes on two cores: the chunked pass does the
full 32k x 1,024 x 151,936 matmul on CPU) or ``python bench/advantage.py --quick`` for a smoke
run; ``--skip-speed`` / ``--skip-memory`` run one part, ``--threads N`` fixes torch's threads.

At 8,192 x 1,024 a good part of the vectorised time is allocating and writing the 32 MiB
``(bs, response_length)`` output, which the loop pays as well: glibc maps allocations of 32 MiB
and more afresh, so every call page-faults its output in. The "scalars" line times the
per-response part alone. PyTorch's ``THP_MEM_ALLOC_ENABLE=1`` (huge pages for large CPU
tensors) can cut the page-fault cost for both in this tight loop, but on a VM that hands freed
huge pages back to the host it made calls spaced like training steps slower, so the library
does not rely on it.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.trainer.egpo import (  # noqa: E402
    egpo_advantages,
    grpo_advantages,
    grpo_scalar_advantages,
)
from workers.trainer.logits import logprobs_and_entropy_from_hidden  # noqa: E402

__all__ = ["main"]

THINK, END_THINK = 151667, 151668


# --------------------------------------------------------------------------- baselines


def loop_grpo_scalars(
    token_level_rewards: torch.Tensor, index: Any, epsilon: float = 1e-6
) -> torch.Tensor:
    """verl's per-sample GRPO loop (std-normalised), before broadcasting over tokens."""
    scores = token_level_rewards.sum(dim=-1)
    by_group: dict[Any, list[torch.Tensor]] = defaultdict(list)
    means: dict[Any, torch.Tensor] = {}
    stds: dict[Any, torch.Tensor] = {}
    with torch.no_grad():
        for i in range(scores.shape[0]):
            by_group[index[i]].append(scores[i])
        for uid, members in by_group.items():
            if len(members) == 1:
                means[uid], stds[uid] = torch.tensor(0.0), torch.tensor(1.0)
            else:
                stacked = torch.stack(members)
                means[uid], stds[uid] = torch.mean(stacked), torch.std(stacked)
        for i in range(scores.shape[0]):
            scores[i] = (scores[i] - means[index[i]]) / (stds[index[i]] + epsilon)
    return scores


def loop_grpo(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any
) -> torch.Tensor:
    return loop_grpo_scalars(token_level_rewards, index).unsqueeze(-1) * response_mask


def baseline_grpo() -> tuple[str, Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]]:
    try:
        from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
    except Exception:  # verl absent or not importable here: use the loop written above
        return "per-sample loop as verl writes it (copy in this script)", loop_grpo

    def run(rewards: torch.Tensor, mask: torch.Tensor, index: Any) -> torch.Tensor:
        return compute_grpo_outcome_advantage(rewards, mask, np.asarray(index, dtype=object))[0]

    return "verl.trainer.ppo.core_algos.compute_grpo_outcome_advantage", run


def loop_egpo(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    index: Any,
    entropies: torch.Tensor,
    responses: torch.Tensor,
    *,
    lam: float = 0.4,
    alpha: float = 2.0,
) -> torch.Tensor:
    """Per-response EGPO ('clip'): loop GRPO, then each row's CoT spans from its markers."""
    scalars = loop_grpo_scalars(rewards, index)
    out = torch.empty_like(scalars)
    for i in range(scalars.shape[0]):
        row = responses[i]
        markers = torch.nonzero((row == THINK) | (row == END_THINK)).flatten().tolist()
        cot = torch.zeros(row.shape[0], dtype=torch.bool)
        inside = bool(markers) and int(row[markers[0]]) == END_THINK
        begin = 0
        for pos in markers:
            if inside:
                cot[begin:pos] = True
            inside = int(row[pos]) == THINK
            begin = pos + 1
        if inside:
            cot[begin:] = True
        cot &= mask[i] != 0
        a = scalars[i]
        if cot.any() and a != 0:
            h = entropies[i][cot].mean().clamp(min=0)
            bound = a.abs() / alpha
            a = a + lam * torch.clamp(h, -bound, bound)
        out[i] = a
    return out.unsqueeze(-1) * mask


# --------------------------------------------------------------------------- part 1


def make_batch(bs: int, length: int, group_size: int, seed: int = 0) -> dict[str, Any]:
    """String uids in groups of ``group_size`` (the last group may be short), every tenth group
    with a -1 negative appended in place of a member, binary and continuous rewards at the last
    valid token, right padding, and responses with <think> spans of every kind."""
    rng = np.random.default_rng(seed)
    groups = (bs + group_size - 1) // group_size
    uids = np.repeat(
        [f"prompt-{g:06d}-{rng.integers(1 << 30):08x}" for g in range(groups)], group_size
    )[:bs]
    rewards = rng.integers(0, 2, size=bs).astype(np.float32)
    continuous = np.repeat(rng.random(groups) < 0.3, group_size)[:bs]
    rewards[continuous] = rng.normal(size=int(continuous.sum())).astype(np.float32)
    negatives = np.arange(group_size - 1, bs, group_size * 10)
    rewards[negatives] = -1.0
    order = rng.permutation(bs)
    uids, rewards = uids[order], rewards[order]
    lengths = rng.integers(length // 4, length + 1, size=bs)
    mask = torch.from_numpy(np.arange(length)[None, :] < lengths[:, None]).float()
    token_rewards = torch.zeros(bs, length)
    token_rewards[torch.arange(bs), torch.from_numpy(lengths - 1)] = torch.from_numpy(rewards)
    responses = torch.from_numpy(rng.integers(0, 150_000, size=(bs, length)))
    kind = rng.integers(0, 4, size=bs)  # closed block, unclosed, closer only, no CoT
    close_at = rng.integers(2, np.maximum(lengths - 1, 3))
    responses[torch.from_numpy(kind <= 1), 0] = THINK
    responses[torch.from_numpy(kind == 0), torch.from_numpy(close_at[kind == 0])] = END_THINK
    responses[torch.from_numpy(kind == 2), torch.from_numpy(close_at[kind == 2])] = END_THINK
    entropies = torch.from_numpy(rng.exponential(1.0, size=(bs, length)).astype(np.float32))
    return {
        "token_level_rewards": token_rewards,
        "response_mask": mask,
        "index": uids.tolist(),
        "entropies": entropies,
        "responses": responses,
    }


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Wall time of one call with the garbage collector off (as timeit does), so the objects
    one implementation leaves behind are not collected on the other's clock."""
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        result = fn()
        return time.perf_counter() - start, result
    finally:
        gc.enable()


def compare(
    baseline: Callable[[], Any], ours: Callable[[], Any], repeats: int
) -> tuple[float, float, Any, Any]:
    """Best-of-``repeats`` wall times of both, run alternately so both see the same load."""
    best_base, best_ours = float("inf"), float("inf")
    base_result = ours_result = None
    for _ in range(repeats):
        seconds, base_result = timed(baseline)
        best_base = min(best_base, seconds)
        seconds, ours_result = timed(ours)
        best_ours = min(best_ours, seconds)
    return best_base, best_ours, base_result, ours_result


def compare_rounds(
    baseline: Callable[[], Any], ours: Callable[[], Any], repeats: int, rounds: int
) -> tuple[list[tuple[float, float]], Any, Any]:
    """``rounds`` independent :func:`compare` rounds: their (baseline, ours) best times and the
    last results. Medians over rounds are steadier than one best-of on a shared machine."""
    times: list[tuple[float, float]] = []
    base_result = ours_result = None
    for _ in range(rounds):
        t_base, t_ours, base_result, ours_result = compare(baseline, ours, repeats)
        times.append((t_base, t_ours))
    return times, base_result, ours_result


def report(
    label: str, times: list[tuple[float, float]], diff: float, target: bool = True
) -> tuple[float, float]:
    """Print the rounds and the medians; return the median (baseline, ours) times."""
    base = statistics.median(t for t, _ in times)
    ours = statistics.median(t for _, t in times)
    ratio = statistics.median(t_base / t_ours for t_base, t_ours in times)
    print(
        "  rounds: " + ", ".join(f"{b * 1e3:.1f}/{o * 1e3:.1f} ms = {b / o:.1f}x" for b, o in times)
    )
    goal = " (target >= 10x)" if target else ""
    print(
        f"{label:44s} loop {base * 1e3:8.1f} ms | vectorised {ours * 1e3:7.1f} ms | "
        f"speed-up {ratio:6.1f}x{goal} | max abs diff {diff:.2e}"
        + (" (target <= 1e-6)" if target else "")
    )
    return base, ours


def speed(args: argparse.Namespace) -> None:
    batch = make_batch(args.bs, args.length, args.group_size)
    rewards, mask, index = batch["token_level_rewards"], batch["response_mask"], batch["index"]
    entropies, responses = batch["entropies"], batch["responses"]
    name, baseline = baseline_grpo()
    print(
        f"== GRPO/EGPO advantages, batch {args.bs} x {args.length}, "
        f"{len(set(index))} groups, torch threads {torch.get_num_threads()} =="
    )
    print(f"baseline: {name}")
    print(
        f"each line: median of {args.rounds} rounds; a round is the best of {args.repeats} "
        "alternating runs per side (rounds listed as loop/vectorised = speed-up)"
    )
    times, ref, ours = compare_rounds(
        lambda: baseline(rewards, mask, index),
        lambda: grpo_advantages(rewards, mask, index)[0],
        args.repeats,
        args.rounds,
    )
    t_loop, _ = report("GRPO advantages (bs, length)", times, (ours - ref).abs().max().item())
    buffer = torch.empty_like(ours)
    times, ref, ours = compare_rounds(
        lambda: baseline(rewards, mask, index),
        lambda: grpo_advantages(rewards, mask, index, out=buffer)[0],
        args.repeats,
        args.rounds,
    )
    report("GRPO advantages into a reused out= buffer", times, (ours - ref).abs().max().item())
    times, sref, sours = compare_rounds(
        lambda: loop_grpo_scalars(rewards, index),
        lambda: grpo_scalar_advantages(rewards, index),
        args.repeats,
        args.rounds,
    )
    report(
        "GRPO per-response scalars (no broadcast)",
        times,
        (sours - sref).abs().max().item(),
        target=False,
    )
    times, eref, egpo = compare_rounds(
        lambda: loop_egpo(rewards, mask, index, entropies, responses),
        lambda: egpo_advantages(
            rewards, mask, index, entropies, responses, cot_start_id=THINK, cot_end_id=END_THINK
        )[0],
        max(1, args.repeats // 2),
        args.rounds,
    )
    _, t_egpo = report(
        "EGPO advantages vs a per-sample EGPO loop",
        times,
        (egpo - eref).abs().max().item(),
    )
    print(
        f"EGPO vectorised vs the GRPO loop baseline: {t_loop / t_egpo:6.1f}x "
        "(EGPO does GRPO plus a CoT mask and an entropy mean over every token)"
    )


# --------------------------------------------------------------------------- part 2


def naive(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float):
    """Full-tensor computation as verl does it without chunking (float32 logits)."""
    logits = hidden @ weight.T
    logits.div_(temperature)
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    probs = torch.softmax(logits, dim=-1)
    entropy = torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
    return log_probs, entropy


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def memory_child(args: argparse.Namespace) -> None:
    """One measurement in this (fresh) process; prints a JSON line."""
    torch.manual_seed(0)
    tokens = args.mem_bs * args.child_length
    # In-place scaling: a temporary copy here would raise the baseline peak and hide part of
    # the computation's own peak.
    hidden = torch.randn(args.mem_bs, args.child_length, args.hidden).mul_(0.05)
    weight = torch.randn(args.vocab, args.hidden).mul_(0.05)
    targets = torch.randint(0, args.vocab, (args.mem_bs, args.child_length))
    hidden.requires_grad_(args.grad)
    weight.requires_grad_(args.grad)
    baseline = peak_rss_bytes()
    start = time.perf_counter()
    with torch.set_grad_enabled(args.grad):
        if args.memory_child == "naive":
            log_probs, entropy = naive(hidden.reshape(tokens, -1), weight, targets.reshape(-1), 0.7)
        else:
            log_probs, entropy = logprobs_and_entropy_from_hidden(
                hidden, weight, targets, temperature=0.7, chunk_size=args.chunk_size
            )
        if args.grad:
            (log_probs.sum() + entropy.sum()).backward()
    elapsed = time.perf_counter() - start
    peak = peak_rss_bytes()
    print(
        json.dumps(
            {
                "mode": args.memory_child,
                "tokens": tokens,
                "baseline": baseline,
                "peak": peak,
                "increment": peak - baseline,
                "seconds": elapsed,
                "checksum": float(log_probs.detach().sum() + entropy.detach().sum()),
            }
        )
    )


def run_child(args: argparse.Namespace, mode: str, length: int) -> dict[str, Any]:
    command = [
        sys.executable,
        __file__,
        "--memory-child",
        mode,
        "--child-length",
        str(length),
        "--mem-bs",
        str(args.mem_bs),
        "--vocab",
        str(args.vocab),
        "--hidden",
        str(args.hidden),
        "--chunk-size",
        str(args.chunk_size),
        *(["--grad"] if args.grad else []),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"memory measurement {mode} at length {length} failed "
            f"(exit {done.returncode}): {done.stderr[-2000:]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def gib(n: float) -> str:
    return f"{n / 2**30:7.2f} GiB"


def memory(args: argparse.Namespace) -> None:
    full_tokens = args.mem_bs * args.mem_length
    logits_bytes = full_tokens * args.vocab * 4
    what = "forward + backward" if args.grad else "forward (no autograd)"
    print(
        f"\n== per-token log-probs + entropy, {what}, batch {args.mem_bs} x length "
        f"{args.mem_length} x vocab {args.vocab} (hidden {args.hidden}); one full float32 "
        f"logits tensor = {gib(logits_bytes)} =="
    )
    print(
        "peak RSS above the inputs (hidden states, lm_head weight, targets), "
        "each in a fresh process"
    )
    per_token: list[float] = []
    measured_full: dict[str, Any] | None = None
    for length in args.naive_lengths:
        r = run_child(args, "naive", length)
        per_token.append(r["increment"] / r["tokens"])
        if length == args.mem_length:
            measured_full = r
        analytic = (
            ""
            if args.grad
            else f"; analytic 3 float32 (tokens x vocab) tensors = "
            f"{gib(3 * r['tokens'] * args.vocab * 4)}"
        )
        print(
            f"  naive   length {length:5d}: {gib(r['increment'])} MEASURED "
            f"({r['increment'] / r['tokens'] / 1e3:8.1f} kB/token{analytic}; "
            f"{r['seconds']:.1f} s)"
        )
    if measured_full is not None:
        naive_full, naive_label = float(measured_full["increment"]), "MEASURED"
    else:
        naive_full, naive_label = max(per_token) * full_tokens, "EXTRAPOLATED"
        analytic = "" if args.grad else f"; analytic {gib(3 * logits_bytes)}"
        print(
            f"  naive   length {args.mem_length:5d}: {gib(naive_full)} EXTRAPOLATED "
            f"(largest measured bytes/token x {full_tokens} tokens{analytic})"
        )
    r = run_child(args, "chunked", args.mem_length)
    chunk_bytes = args.chunk_size * args.vocab * 4
    analytic = "" if args.grad else f"; analytic 2 float32 (chunk x vocab) = {gib(2 * chunk_bytes)}"
    print(
        f"  chunked length {args.mem_length:5d}: {gib(r['increment'])} MEASURED "
        f"(chunk {args.chunk_size} tokens{analytic}; {r['seconds']:.1f} s; "
        f"process RSS before it {gib(r['baseline'])}, interpreter and inputs)"
    )
    if chunk_bytes < 32 * 2**20:
        print(
            f"  note: one chunk tensor ({chunk_bytes / 2**20:.0f} MiB) is below glibc's 32 MiB "
            "mmap threshold, so freed chunks may stay in per-thread malloc arenas and peak RSS "
            "over-count the live memory; MALLOC_ARENA_MAX=1 shows the live peak"
        )
    ratio = max(r["increment"], 1) / naive_full
    print(
        f"  chunked / naive peak above inputs: 1/{1 / ratio:.0f} = {ratio:.4f} "
        f"(target <= 1/8 = 0.125; naive side {naive_label})"
    )
    total_ratio = r["peak"] / (naive_full + r["baseline"])
    print(
        f"  chunked / naive total process peak: {total_ratio:.4f} "
        f"(naive total = its increment + the same inputs)"
    )


# --------------------------------------------------------------------------- entry point


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bs", type=int, default=8192)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds per comparison; lines print their median"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's)"
    )
    parser.add_argument("--mem-bs", type=int, default=8)
    parser.add_argument("--mem-length", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument(
        "--naive-lengths", type=lambda s: [int(x) for x in s.split(",")], default=[128, 256, 512]
    )
    parser.add_argument(
        "--grad",
        action="store_true",
        help="measure forward + backward (gradients of hidden states and lm_head weight)",
    )
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    parser.add_argument("--memory-child", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    parser.add_argument("--child-length", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.bs, args.length, args.repeats, args.rounds = 256, 64, 1, 1
        args.mem_bs, args.mem_length, args.vocab, args.hidden = 2, 1024, 32_000, 64
        args.chunk_size, args.naive_lengths = 128, [256, 512]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.memory_child:
        memory_child(args)
        return
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if not args.skip_speed:
        speed(args)
    if not args.skip_memory:
        memory(args)


if __name__ == "__main__":
    main()
