"""Benchmark: a learning ablation on the ``calc`` tool-use task — which parts of the recipe help.

Each arm runs ``trajstore demo --task calc`` as a user runs it (real Celery workers on the
embedded servers of one data folder, so every arm of a seed starts from the same cached
warm-started policy), with the same seeds, the same budget of episodes (``--steps`` versions
of ``--groups`` × ``--group-size`` episodes) and the same learning rate:

========================  =====================================================================
arm                       ``trajstore demo`` options
========================  =====================================================================
``grpo``                  ``--estimator grpo --no-negatives``
``grpo+neg``              ``--estimator grpo`` (failed tool calls trained as negative samples)
``egpo``                  ``--no-negatives`` (EGPO's clip-form entropy bonus on ``<think>``)
``egpo+neg``              the defaults
``egpo+neg, no rollback`` ``--no-rollback`` (a failed call's error stays in the context)
========================  =====================================================================

For every arm it prints the mean strict reward and tool error rate per policy version
(averaged over the seeds), then the final values — the mean over the last three versions of
each run — as mean ± standard deviation over the seeds, and saves one plot with all arms
(``--plot``). Then, for every arm beside ``grpo`` (when both ran), its effect against plain
GRPO: the difference of final reward and of final tool error rate, paired by seed (a seed
starts every arm from the same warm start and the same task ids), as the mean difference with
its 95% confidence interval (Student's t over the seeds). And for every arm, in how many seeds
it kept the main job's promise: the mean reward of the last three versions at least 0.1 above
the first three's, and a lower tool error rate. Each run's summary is also appended to
``--out`` as one JSON line, so that a long sweep can be read before it ends. The last line is

    RESULT <arm>=<final reward> ... <arm>_vs_grpo=<effect> <arm>_ci_low=… <arm>_ci_high=…
    <arm>_learns=<seeds that kept the promise> seeds=<n>
    (arm names with ``+`` as ``_`` and ", no rollback" as ``_no_rollback``)

    python bench/learning.py                          # 5 arms × 10 seeds × 12 versions
    python bench/learning.py --arms grpo egpo+neg --seeds 0 1 2 --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["ARMS", "main"]

#: Arm name -> the ``trajstore demo`` options that make it.
ARMS: dict[str, tuple[str, ...]] = {
    "grpo": ("--estimator", "grpo", "--no-negatives"),
    "grpo+neg": ("--estimator", "grpo"),
    "egpo": ("--no-negatives",),
    "egpo+neg": (),
    "egpo+neg, no rollback": ("--no-rollback",),
}


def _run(arm: str, seed: int, data_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
    env["TRAJSTORE_DATA_DIR"] = str(data_dir)
    command = [sys.executable, "-m", "trajstore", "demo", "--task", "calc", "--json",
               "--seed", str(seed), "--steps", str(args.steps),
               "--group-size", str(args.group_size), "--groups", str(args.groups),
               *(("--lr", str(args.lr)) if args.lr else ()),
               *(("--mini-batch-size", str(args.mini_batch_size))
                 if args.mini_batch_size else ()), *ARMS[arm]]
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=7200)
    if done.returncode != 0:
        raise SystemExit(f"{arm} seed {seed}: the demo failed:\n{done.stdout[-2000:]}\n"
                         f"{done.stderr[-2000:]}")
    summary = json.loads(next(line for line in reversed(done.stdout.splitlines())
                              if line.startswith('{"run_id"')))
    summary["seconds"] = time.perf_counter() - started
    return summary


def _final(values: list[float]) -> float:
    return statistics.mean(values[-3:]) if values else 0.0


#: Student's t quantile 0.975 by degrees of freedom (1..20); beyond, the normal's.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086)


def paired_effect(arm: list[float], base: list[float]) -> tuple[float, float, float]:
    """Mean of the per-seed differences ``arm - base`` and its 95% confidence interval
    (Student's t; the interval is the mean itself with one seed)."""
    differences = [a - b for a, b in zip(arm, base, strict=True)]
    mean = statistics.mean(differences)
    if len(differences) < 2:
        return mean, mean, mean
    df = len(differences) - 1
    t = _T975[df - 1] if df <= len(_T975) else 1.96
    half = t * statistics.stdev(differences) / len(differences) ** 0.5
    return mean, mean - half, mean + half


def learns(run: dict[str, Any], gain: float = 0.1) -> bool:
    """The main job's promise for one run: the last three versions' mean reward at least
    ``gain`` above the first three's, and their tool error rate lower."""
    rewards, errors = run["reward_by_version"], run["tool_error_rate_by_version"]
    return (statistics.mean(rewards[-3:]) >= statistics.mean(rewards[:3]) + gain
            and statistics.mean(errors[-3:]) < statistics.mean(errors[:3]))


def _spread(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.3f}" if values else "-"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def _per_version(runs: list[dict[str, Any]], key: str) -> list[float]:
    length = min(len(r[key]) for r in runs)
    return [statistics.mean(r[key][v] for r in runs) for v in range(length)]


def _plot(results: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for arm, runs in results.items():
        rewards = _per_version(runs, "reward_by_version")
        errors = _per_version(runs, "tool_error_rate_by_version")
        left.plot(range(len(rewards)), rewards, marker="o", label=arm)
        right.plot(range(len(errors)), errors, marker="o", label=arm)
    left.set(title="strict reward (mean over seeds)", xlabel="policy version")
    right.set(title="tool error rate (mean over seeds)", xlabel="policy version")
    left.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS),
                        metavar="ARM", help=f"arms to run, of {list(ARMS)}")
    parser.add_argument("--seeds", nargs="+", type=int, default=list(range(10)))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--lr", type=float, default=None, help="learning rate of every arm "
                        "(default: the demo's for calc)")
    parser.add_argument("--mini-batch-size", type=int, default=None,
                        help="samples per optimizer step of every arm (default: the demo's, 8; "
                             "1000 trains each version's batch in one step, as the first five-arm "
                             "table of docs/performance.md was measured)")
    parser.add_argument("--data-dir", type=Path, default=None, help="data folder shared by "
                        "the runs (default: a fresh temporary one)")
    parser.add_argument("--plot", type=Path, default=Path("learning.png"))
    parser.add_argument("--out", type=Path, default=Path("learning.jsonl"),
                        help="each run's summary, one JSON line, appended as it ends")
    parser.add_argument("--summarize", nargs="+", type=Path, default=None, metavar="JSONL",
                        help="run nothing: report the runs recorded in these --out files "
                             "(sweeps split over several processes)")
    args = parser.parse_args(argv)
    for name in ("steps", "group_size", "groups"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if any(seed < 0 for seed in args.seeds):
        parser.error("--seeds must be >= 0")
    if args.summarize:
        recorded: dict[str, dict[int, dict[str, Any]]] = {}
        for path in args.summarize:
            for line in path.read_text().splitlines():
                run = json.loads(line)
                recorded.setdefault(run["arm"], {})[run["seed"]] = run
        seeds = sorted(set.intersection(*(set(runs) for runs in recorded.values())))
        if not seeds:
            parser.error("--summarize: no seed was run by every arm")
        return _report({arm: [runs[s] for s in seeds] for arm, runs in recorded.items()},
                       seeds, args)
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="bench-learning-"))
    results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in args.arms}
    # Seeds outside, arms inside: load drift over the run hits every arm alike.
    for seed in args.seeds:
        for arm in args.arms:
            run = _run(arm, seed, data_dir, args)
            results[arm].append(run)
            with args.out.open("a") as out:
                out.write(json.dumps({"arm": arm, "seed": seed, **run}) + "\n")
            print(f"{arm:<22} seed {seed}: reward "
                  + " ".join(f"{x:.2f}" for x in run["reward_by_version"])
                  + " | tool errors " + " ".join(f"{x:.2f}" for x in
                                                  run["tool_error_rate_by_version"])
                  + f" ({run['seconds']:.0f} s)", flush=True)
    return _report(results, args.seeds, args)


def _report(results: dict[str, list[dict[str, Any]]], seeds: list[int],
            args: argparse.Namespace) -> dict[str, Any]:
    print(f"\n{len(seeds)} seeds ({' '.join(map(str, seeds))}) × "
          f"{len(next(iter(results.values()))[0]['reward_by_version'])} versions played; "
          "final = mean of the last 3 versions")
    print(f"{'arm':<22} {'reward v0':>10} {'final reward':>16} {'tool err v0':>12} "
          f"{'final tool err':>16} {'rollbacks':>9} {'negatives':>9}")
    finals: dict[str, float] = {}
    for arm, runs in results.items():
        rewards = [_final(r["reward_by_version"]) for r in runs]
        errors = [_final(r["tool_error_rate_by_version"]) for r in runs]
        finals[arm] = statistics.mean(rewards)
        print(f"{arm:<22} {statistics.mean(r['reward_first'] for r in runs):>10.3f} "
              f"{_spread(rewards):>16} "
              f"{statistics.mean(r['tool_error_rate_first'] for r in runs):>12.3f} "
              f"{_spread(errors):>16} "
              f"{statistics.mean(r['rollbacks'] for r in runs):>9.0f} "
              f"{statistics.mean(r['negatives_trained'] for r in runs):>9.0f}")
    _plot(results, args.plot)
    print(f"plot: {args.plot}")
    key = {arm: arm.replace("+", "_").replace(", no rollback", "_no_rollback")
           for arm in results}
    fields = [f"{key[arm]}={value:.3f}" for arm, value in finals.items()]
    effects = _effects(results)
    for arm, (reward, errors) in effects.items():
        fields += [f"{key[arm]}_vs_grpo={reward[0]:+.3f}", f"{key[arm]}_ci_low={reward[1]:+.3f}",
                   f"{key[arm]}_ci_high={reward[2]:+.3f}",
                   f"{key[arm]}_tool_err_vs_grpo={errors[0]:+.3f}"]
    print(f"\nthe main job's promise (last three versions >= first three + 0.1, fewer tool "
          f"errors), seeds that kept it of {len(seeds)}:")
    for arm, runs in results.items():
        kept = sum(learns(run) for run in runs)
        print(f"{arm:<22} {kept}/{len(runs)}")
        fields.append(f"{key[arm]}_learns={kept}")
    print("RESULT " + " ".join([*fields, f"seeds={len(seeds)}"]))
    return {"results": results, "finals": finals, "effects": effects}


def _effects(results: dict[str, list[dict[str, Any]]]
             ) -> dict[str, tuple[tuple[float, float, float], tuple[float, float, float]]]:
    """Each arm's paired effect against ``grpo`` on final reward and final tool error rate
    (printed as a table; empty without the grpo arm)."""
    base = results.get("grpo")
    if not base:
        return {}
    print("\neffect against plain GRPO, paired by seed: mean difference [95% CI]")
    print(f"{'arm':<22} {'final reward':>28} {'final tool error rate':>28}")
    effects = {}
    for arm, runs in results.items():
        if arm == "grpo":
            continue
        reward = paired_effect([_final(r["reward_by_version"]) for r in runs],
                               [_final(r["reward_by_version"]) for r in base])
        errors = paired_effect([_final(r["tool_error_rate_by_version"]) for r in runs],
                               [_final(r["tool_error_rate_by_version"]) for r in base])
        effects[arm] = (reward, errors)
        print(f"{arm:<22} {reward[0]:>+8.3f} [{reward[1]:+.3f}, {reward[2]:+.3f}]"
              f"{errors[0]:>+10.3f} [{errors[1]:+.3f}, {errors[2]:+.3f}]")
    return effects


if __name__ == "__main__":
    main()
