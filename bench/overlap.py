"""Benchmark: the main job with rollouts overlapping training against strictly alternating.

Runs ``trajstore demo`` (real Celery workers on the embedded servers of a fresh data folder,
the tiny model, EGPO) twice with the same seed,
task, group sizes and number of policy versions: once with ``overlap`` (the next batch rolls
out while the trainer trains; batches are one version behind and corrected by importance
sampling) and once without (each batch waits for the policy just trained). Arms alternate
over ``--rounds``, so load drifts hit both.

Per arm it prints the wall time of the whole run, the reward per policy version, and the time
(from the run's creation to the last episode of that version) until the mean reward of a
version first reached the target: ``--target`` (default: 90% of the lowest best reward of all
runs, so every run reaches it). The ratio is
``overlap / alternating`` of the median times to the target. The last line is

    RESULT overlap_time_to_reward=<x> overlap_total_time=<y>

    python bench/overlap.py                       # 12 versions, 2 rounds
    python bench/overlap.py --steps 4 --rounds 1 --group-size 4 --groups 2
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

__all__ = ["main"]


def _arm(overlap: bool, args: argparse.Namespace) -> dict[str, Any]:
    """One ``trajstore demo`` in a fresh data folder (the embedded servers), run as a user
    runs it; then, from its store, the mean reward of each policy version and when the
    last of that version's episodes finished, counted from the run's creation."""
    from store.eventlog import EventStore
    from store.settings import Settings

    data_dir = Path(tempfile.mkdtemp(prefix="bench-overlap-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
    env["TRAJSTORE_DATA_DIR"] = str(data_dir)
    command = [sys.executable, "-m", "trajstore", "demo", "--json", "--seed", str(args.seed),
               "--steps", str(args.steps), "--group-size", str(args.group_size),
               "--groups", str(args.groups), "--task", args.task,
               "--overlap" if overlap else "--no-overlap"]
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    total = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"the demo failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    store = EventStore.open(Settings(data_dir=data_dir))
    try:
        with store.db.connection() as conn:
            created = conn.execute(
                "SELECT min(occurred_at) FROM events WHERE stream_id = %s",
                (f"run-{summary['run_id']}",)).fetchone()[0]
            rows = conn.execute(
                "SELECT policy_version, avg(reward), max(finished_at) FROM episodes"
                " WHERE run_id = %s AND status NOT IN ('aborted', 'invalid')"
                " GROUP BY policy_version ORDER BY policy_version",
                (summary["run_id"],)).fetchall()
    finally:
        store.close()
    return {"overlap": overlap, "run_id": summary["run_id"], "seconds": total,
            "rewards": {int(v): float(r) for v, r, _ in rows},
            "seen_at": {int(v): (at - created).total_seconds() for v, _, at in rows}}


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
                        help="mean reward to reach (default: 90%% of the runs' lowest best)")
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
    if target is None:  # one every run reached
        target = 0.9 * min(max(r["rewards"].values()) for r in runs)
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
