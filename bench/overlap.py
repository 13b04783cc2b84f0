"""Benchmark: the main job with rollouts overlapping training against strictly alternating.

Runs ``trajstore``'s main job (:func:`trajstore.demo.run_demo`: real Celery workers on the
configured servers or the embedded default, the tiny model, EGPO) twice with the same seed,
task, group sizes and number of policy versions: once with ``overlap`` (the next batch rolls
out while the trainer trains; batches are one version behind and corrected by importance
sampling) and once without (each batch waits for the policy just trained). Arms alternate
over ``--rounds``, so load drifts hit both.

Per arm it prints the wall time of the whole run, the reward per policy version, and the wall
time until the mean reward of a version first reached the target: ``--target`` (default: 90%
of the lower of the two arms' best rewards, so both reach it). The ratio is
``overlap / alternating`` of the median times to the target. The last line is

    RESULT overlap_time_to_reward=<x> overlap_total_time=<y>

    python bench/overlap.py                       # 12 versions, 2 rounds
    python bench/overlap.py --steps 4 --rounds 1 --group-size 4 --groups 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

__all__ = ["main"]


def _arm(overlap: bool, args: argparse.Namespace) -> dict[str, Any]:
    """One run of the main job in a fresh data folder; the wall time of every version."""
    from store.eventlog import EventStore
    from store.settings import Settings
    from trajstore.demo import DemoOptions, run_demo

    data_dir = Path(tempfile.mkdtemp(prefix="bench-overlap-"))
    settings = Settings(data_dir=data_dir)
    store = EventStore.open(settings)
    options = DemoOptions(steps=args.steps, group_size=args.group_size,
                          groups_per_step=args.groups, seed=args.seed, task=args.task,
                          overlap=overlap)
    started = time.perf_counter()
    reached: dict[int, float] = {}

    def on_version(rows: list[Any]) -> None:
        for row in rows:
            reached.setdefault(row.version, time.perf_counter() - started)

    try:
        run_id, rows = run_demo(store, settings, options, on_version=on_version)
    finally:
        store.close()
    total = time.perf_counter() - started
    return {"overlap": overlap, "run_id": run_id, "seconds": total,
            "rewards": {row.version: row.reward_mean for row in rows},
            "seen_at": {row.version: reached.get(row.version, total) for row in rows}}


def _time_to(run: dict[str, Any], target: float) -> float:
    """Seconds until a version's mean reward first reached ``target`` (inf: never)."""
    times = [run["seen_at"][v] for v, reward in sorted(run["rewards"].items())
             if reward >= target]
    return min(times) if times else float("inf")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark and print (and return) its numbers."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--task", choices=("digits", "calc"), default="digits")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--target", type=float, default=None,
                        help="mean reward to reach (default: 90%% of the arms' lower best)")
    args = parser.parse_args(argv)
    for name in ("steps", "group_size", "groups", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")

    runs: list[dict[str, Any]] = []
    for _ in range(args.rounds):
        for overlap in (True, False):
            runs.append(_arm(overlap, args))
            print(f"{'overlap' if overlap else 'alternating':11s} {runs[-1]['seconds']:7.1f} s "
                  f"rewards {[round(r, 3) for r in runs[-1]['rewards'].values()]}", flush=True)
    arms = {name: [r for r in runs if r["overlap"] == flag]
            for name, flag in (("overlap", True), ("alternating", False))}
    target = args.target
    if target is None:
        target = 0.9 * min(max(max(r["rewards"].values()) for r in arm)
                           for arm in arms.values())
    report: dict[str, Any] = {"target": target, "steps": args.steps, "runs": runs}
    for name, arm in arms.items():
        report[name] = {"total_s": statistics.median(r["seconds"] for r in arm),
                        "to_target_s": statistics.median(_time_to(r, target) for r in arm)}
        print(f"{name:11s} total {report[name]['total_s']:7.1f} s   reward {target:.3f} "
              f"reached after {report[name]['to_target_s']:7.1f} s (median of {len(arm)})")
    ratio_target = report["overlap"]["to_target_s"] / report["alternating"]["to_target_s"]
    ratio_total = report["overlap"]["total_s"] / report["alternating"]["total_s"]
    print(json.dumps(report, indent=2, default=str))
    print(f"RESULT overlap_time_to_reward={ratio_target:.2f} "
          f"overlap_total_time={ratio_total:.2f}")
    return report


if __name__ == "__main__":
    main()
