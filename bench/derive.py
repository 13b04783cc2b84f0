"""Dataset derivation benchmark: episodes/s turned into a stored dataset version under
rules, against a plain sequential read of the same events in the same run.

Records ``episodes`` episodes of ``turns`` tool-calling turns each in one run per round
(Qwen3's chat template and tokenizer, prompts rendered and tokenized as an engine would:
``bench/replay.py``'s episodes, in GRPO groups of four), then times, in alternating rounds:
(a) reading every episode's events one stream at a time (``read_stream``, token payloads
decoded), (b) deriving a dataset version of the run in this process (``derive_dataset``:
listing the run's episodes, reading their events in batches, replaying each under the rules,
capping negatives, computing GRPO advantages, hashing every row and writing the version in
one transaction) and (c) the same derivation on a ``DerivePool`` of ``--jobs`` processes
(started and warmed before the timing, as a long-lived worker would hold it). Target: (b) at
least 0.5x the plain read, (c) faster than it.

Each round times (a), (b) and (c) ``--repeat`` times, interleaved (each derivation under a
name of its own, so every one writes its version), and keeps the fastest time of each: on
a machine shared with other work a single timing mostly measures whoever else ran then
(``--repeat 1`` is one timing of each per round).

    python bench/derive.py [--episodes 40 --turns 6 --rounds 3 --repeat 3 --jobs 2 --last-turn]

It ends with a line ``RESULT derive_vs_read_1p=<b/a> derive_vs_read_2p=<c/a> ...`` (medians
over the rounds; rates compared, so above 1 is faster than the read). ``derive_vs_read_1p_cpu``
compares the CPU time this process spent on (a) and (b) instead of their wall-clock time:
the database server's share is left out of both, and so is most of what other work on the
machine does to the timings.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import scratch_database  # noqa: E402
from bench.replay import episode  # noqa: E402
from store.db import Database  # noqa: E402
from store.eventlog import NO_STREAM, EventStore, run_stream_id  # noqa: E402
from store.events import RunConfig, RunCreated  # noqa: E402
from store.settings import Settings  # noqa: E402
from workers.datasets import DerivePool, derive_dataset  # noqa: E402
from workers.engines.tokenizers import load_tokenizer  # noqa: E402


def record(store: EventStore, tokenizer, run_id: str, count: int, turns: int) -> list[str]:
    store.append(run_stream_id(run_id), [RunCreated(run_id=run_id, config=RunConfig(
        tokenizer="qwen3", group_size=4))], NO_STREAM)
    ids = []
    for e in range(count):
        ep = f"{run_id}-ep{e}"
        store.append(ep, episode(tokenizer, run_id, f"g{e // 4}", turns, e), NO_STREAM)
        ids.append(ep)
    return ids


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=40)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=3,
                        help="timings of each side per round, the fastest kept")
    parser.add_argument("--jobs", type=int, default=2,
                        help="processes of the DerivePool timed in (c)")
    parser.add_argument("--last-turn", action="store_true",
                        help="train only each sample's last turn (a rule that reshapes masks)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    rules = {"advantage": {"kind": "grpo"},
             "train": {"turns": "last" if args.last_turn else "all"}}
    tokenizer = load_tokenizer("qwen3")
    one: list[float] = []
    two: list[float] = []
    cpu: list[float] = []
    with scratch_database() as url, DerivePool(url, jobs=args.jobs) as pool:
        store = EventStore(Database(url, max_size=2), Settings(database_url=url))
        # Warm up: the tokenizer's tables in this process and in every pool process.
        warm = f"warm-{uuid.uuid4().hex[:6]}"
        record(store, tokenizer, warm, 4 * args.jobs, 1)
        derive_dataset(store, "warm", [warm], rules)
        derive_dataset(store, "warm-pool", [warm], rules, pool=pool, batch=1)
        for r in range(args.rounds):
            run_id = f"bench-{r}-{uuid.uuid4().hex[:6]}"
            ids = record(store, tokenizer, run_id, args.episodes, args.turns)
            n_events = sum(len(store.read_stream(ep)) for ep in ids)
            read_s = one_s = two_s = read_cpu = one_cpu = float("inf")
            for k in range(args.repeat):
                t0, c0 = time.perf_counter(), time.process_time()
                for ep in ids:
                    store.read_stream(ep)
                read_s = min(read_s, time.perf_counter() - t0)
                read_cpu = min(read_cpu, time.process_time() - c0)
                t0, c0 = time.perf_counter(), time.process_time()
                single = derive_dataset(store, f"d1-{r}-{k}", [run_id], rules)
                one_s = min(one_s, time.perf_counter() - t0)
                one_cpu = min(one_cpu, time.process_time() - c0)
                t0 = time.perf_counter()
                pooled = derive_dataset(store, f"d2-{r}-{k}", [run_id], rules, pool=pool)
                two_s = min(two_s, time.perf_counter() - t0)
                # The same rules over the same events: the same rows, whichever way.
                assert single.created and pooled.created
                assert single.version.content_hash == pooled.version.content_hash
                assert single.episodes == args.episodes, single
            one.append(read_s / one_s)
            two.append(read_s / two_s)
            cpu.append(read_cpu / one_cpu)
            print(f"  round {r + 1}: plain read {len(ids) / read_s:7.1f} episodes/s "
                  f"({n_events / read_s:8.1f} events/s) | derive, 1 process "
                  f"{len(ids) / one_s:7.1f} episodes/s (ratio {one[-1]:.2f}) | derive, "
                  f"{args.jobs} processes {len(ids) / two_s:7.1f} episodes/s "
                  f"(ratio {two[-1]:.2f}) | CPU of this process per episode: read "
                  f"{read_cpu / len(ids) * 1e3:.2f} ms, derive {one_cpu / len(ids) * 1e3:.2f} ms "
                  f"| {single.version.num_rows} rows")
        store.close()

    def verdict(ratio: float, target: float) -> str:
        return f"{ratio:.2f} ({'met' if ratio >= target else 'not met'})"

    m1, m2, mc = statistics.median(one), statistics.median(two), statistics.median(cpu)
    print(f"{args.episodes} episodes x {args.turns} turns per round"
          f"{' (last turn only)' if args.last_turn else ''}, fastest of {args.repeat}; median "
          f"derive/read: one process "
          f"{verdict(m1, 0.5)} against 0.5, {args.jobs} processes {verdict(m2, 1.0)} "
          f"against 1.0")
    print(f"RESULT derive_vs_read_1p={m1:.3f} derive_vs_read_2p={m2:.3f} "
          f"derive_vs_read_1p_cpu={mc:.3f} "
          f"jobs={args.jobs} episodes={args.episodes} turns={args.turns} repeat={args.repeat}")
    return {"1p": m1, "2p": m2}


if __name__ == "__main__":
    main()
