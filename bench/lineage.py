"""Lineage query benchmark: "what fed step k of run R" and "which steps trained episode e"
(``store.lineage``) on a ``step_samples`` table of a million rows.

The rows are generated in the database with ``generate_series`` (as a trainer's
``policy_updated`` events would have written them): ``--runs`` runs of ``--steps`` steps of
``--batch`` samples each, every episode giving two samples to a step, over ``--epochs``
passes (an episode is trained by that many steps of its run). Then it checks with
EXPLAIN that both queries are index scans of ``step_samples_step_idx`` and
``step_samples_episode_idx`` (no sequential scan), and times each over ``--queries`` random
steps and episodes (through ``step_lineage`` / ``episode_lineage``, one connection of the
pool).

    python bench/lineage.py [--runs 100 --steps 1000 --batch 10 --queries 200]

It ends with a line ``RESULT step_query_ms=<median> episode_query_ms=<median> rows=<n>``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg  # noqa: E402

from bench.common import scratch_database  # noqa: E402
from store.db import Database  # noqa: E402
from store.lineage import EPISODE_QUERY, STEP_QUERY, episode_lineage, step_lineage  # noqa: E402

__all__ = ["explain", "main", "seed"]

SEED = """
INSERT INTO step_samples (run_id, policy_version, step, position, sample_id, episode_id,
                          reward, dataset_id, event_position)
SELECT 'run-' || r, s + 1, s + 1, p, (r * %(steps)s + s) * %(batch)s + p,
       'ep-' || r || '-' || (s %% %(per_epoch)s) || '-' || (p / 2),
       (p %% 3) / 2.0, NULL, r * %(steps)s + s
FROM generate_series(0, %(runs)s - 1) r, generate_series(0, %(steps)s - 1) s,
     generate_series(0, %(batch)s - 1) p;
"""


def seed(url: str, *, runs: int, steps: int, batch: int, epochs: int = 1) -> int:
    """Fill ``step_samples`` of the database at ``url`` with ``runs * steps * batch`` rows
    (module docstring; each episode trained by ``epochs`` steps) and analyze it; returns the
    row count."""
    with psycopg.connect(url) as conn:
        conn.execute("SET LOCAL synchronous_commit = off")
        conn.execute(SEED, {"runs": runs, "steps": steps, "batch": batch,
                            "per_epoch": max(1, steps // epochs)})
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE step_samples")
        (count,) = conn.execute("SELECT count(*) FROM step_samples").fetchone() or (0,)
    return int(count)


def explain(conn: psycopg.Connection[Any], statement: str, params: dict[str, Any]
            ) -> list[dict[str, Any]]:
    """Every node of the plan of ``statement`` with ``params`` bound (as the store binds
    them)."""
    row = conn.execute(f"EXPLAIN (FORMAT JSON) {statement}", params).fetchone()
    assert row is not None
    plan = json.loads(row[0]) if isinstance(row[0], str) else row[0]
    nodes, todo = [], [plan[0]["Plan"]]
    while todo:
        node = todo.pop()
        nodes.append(node)
        todo.extend(node.get("Plans", []))
    return nodes


def plans(url: str, run: str, step: int, episode: str) -> dict[str, list[dict[str, Any]]]:
    """The plan nodes of both lineage queries for one step and one episode."""
    with psycopg.connect(url) as conn:
        return {"step": explain(conn, STEP_QUERY, {"run": run, "step": step}),
                "episode": explain(conn, EPISODE_QUERY, {"episode": episode})}


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--queries", type=int, default=200)
    args = parser.parse_args(argv)
    rng = random.Random(0)
    with scratch_database() as url:
        started = time.perf_counter()
        rows = seed(url, runs=args.runs, steps=args.steps, batch=args.batch,
                    epochs=args.epochs)
        print(f"seeded {rows} step_samples rows in {time.perf_counter() - started:.1f} s")
        targets = [(f"run-{rng.randrange(args.runs)}", rng.randrange(args.steps) + 1)
                   for _ in range(args.queries)]
        for name, nodes in plans(url, targets[0][0], targets[0][1],
                                 f"ep-0-{args.steps // args.epochs // 2}-0").items():
            kinds = sorted({n["Node Type"] + (f" ({n['Index Name']})" if "Index Name" in n
                                              else "") for n in nodes})
            print(f"{name} query plan: {', '.join(kinds)}")
        db = Database(url, max_size=1)
        try:
            step_ms, episode_ms = [], []
            for run, step in targets:
                t = time.perf_counter()
                (fed,) = step_lineage(db, run, step)
                step_ms.append((time.perf_counter() - t) * 1000)
                assert len(fed.samples) == args.batch
                episode = fed.samples[0].episode_id
                t = time.perf_counter()
                assert episode_lineage(db, episode)
                episode_ms.append((time.perf_counter() - t) * 1000)
        finally:
            db.close()
    s, e = statistics.median(step_ms), statistics.median(episode_ms)
    print(f"{args.queries} queries each: step {s:.2f} ms median ({max(step_ms):.2f} max), "
          f"episode {e:.2f} ms median ({max(episode_ms):.2f} max)")
    print(f"RESULT step_query_ms={s:.3f} episode_query_ms={e:.3f} rows={rows}")
    return {"step_query_ms": s, "episode_query_ms": e, "rows": float(rows)}


if __name__ == "__main__":
    main()
