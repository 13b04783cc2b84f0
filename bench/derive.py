"""Dataset derivation benchmark: episodes/s turned into a stored dataset version under
rules, against a plain sequential read of the same events in the same run.

Records ``episodes`` episodes of ``turns`` tool-calling turns each in one run per round
(Qwen3's chat template and tokenizer, prompts rendered and tokenized as an engine would:
``bench/replay.py``'s episodes, in GRPO groups of four) and projects them (untimed: a live
replay worker projects each episode as it finishes), then times, in alternating rounds:
(a) reading every episode's events one stream at a time (``read_stream``, token payloads
decoded), (b) deriving a dataset version of the run in this process (``derive_dataset``:
listing the run's episodes, taking each one's samples from its current projection since the
rules replay as the run does, reading its other events for the filters and the reward,
capping negatives, computing GRPO advantages, hashing every row and writing the version in
one transaction), (c) the same derivation on a ``DerivePool`` of ``--jobs`` processes
(started and warmed before the timing, as a long-lived worker would hold it), and (d), (e)
the same two derivations replaying every episode from its events
(``from_projection=False``: what rules that change the replay, or episodes without a current
projection, cost). Target: (b) at least 0.5x the plain read, (c) faster than it.
``--last-turn`` trains only each sample's last turn, a rule the projection cannot serve:
(b) and (c) replay too. ``--rescore`` scores every episode with a reward function
(``tool_calls_reward``) instead of its recorded reward, as re-scoring a run does: (b) and (c)
take the samples from the projection and read every event (the function is given them all).

Each round times (a) to (e) ``--repeat`` times, interleaved (each derivation under a name of
its own, so every one writes its version), and keeps the fastest time of each: on a machine
shared with other work a single timing mostly measures whoever else ran then (``--repeat 1``
is one timing of each per round).

    python bench/derive.py [--episodes 40 --turns 6 --rounds 3 --repeat 3 --jobs 2 --last-turn
                            --rescore]

It ends with a line ``RESULT derive_vs_read_1p=<b/a> derive_vs_read_2p=<c/a>
replay_derive_vs_read_1p=<d/a> replay_derive_vs_read_2p=<e/a> ... path=<projection|replay>``
(medians over the rounds; rates compared, so above 1 is faster than the read; ``path``: what
(b) and (c) took). ``derive_vs_read_1p_cpu`` and ``replay_derive_vs_read_1p_cpu`` compare
the CPU time this process spent on (a) and on (b) or (d) instead of their wall-clock time:
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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import scratch_database  # noqa: E402
from bench.replay import episode  # noqa: E402
from store.db import Database  # noqa: E402
from store.eventlog import NO_STREAM, EventStore, run_stream_id  # noqa: E402
from store.events import RunConfig, RunCreated  # noqa: E402
from store.settings import Settings  # noqa: E402
from workers.datasets import DerivePool, derive_dataset  # noqa: E402
from workers.engines.tokenizers import load_tokenizer  # noqa: E402
from workers.replay.jobs.project import project_episodes  # noqa: E402


def record(store: EventStore, tokenizer, run_id: str, count: int, turns: int) -> list[str]:
    store.append(run_stream_id(run_id), [RunCreated(run_id=run_id, config=RunConfig(
        tokenizer="qwen3", group_size=4))], NO_STREAM)
    ids = []
    for e in range(count):
        ep = f"{run_id}-ep{e}"
        store.append(ep, episode(tokenizer, run_id, f"g{e // 4}", turns, e), NO_STREAM)
        ids.append(ep)
    return ids


def tool_calls_reward(episode: Any) -> float:
    """``--rescore``'s reward function: 1.0 for an episode whose LLM calls requested at most
    three tool calls, else 0.5 (it reads every event, LLM calls included)."""
    calls = sum(len(e.response.get("tool_calls") or ())
                for e in episode.events if e.type == "llm_called")
    return 1.0 if calls <= 3 else 0.5


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
    parser.add_argument("--rescore", action="store_true",
                        help="score every episode with a reward function (bench.derive:"
                        "tool_calls_reward) instead of its recorded reward: re-scoring a run")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    rules: dict[str, Any] = {"advantage": {"kind": "grpo"},
                             "train": {"turns": "last" if args.last_turn else "all"}}
    if args.rescore:
        rules["reward"] = {"function": "bench.derive:tool_calls_reward"}
    tokenizer = load_tokenizer("qwen3")
    kinds = ("1p", "2p", "replay_1p", "replay_2p")
    ratios: dict[str, list[float]] = {k: [] for k in kinds}
    cpu: list[float] = []
    replay_cpu: list[float] = []
    projected_path = not args.last_turn
    with scratch_database() as url, DerivePool(url, jobs=args.jobs) as pool:
        store = EventStore(Database(url, max_size=2), Settings(database_url=url))
        # Warm up: the tokenizer's tables in this process and in every pool process, both
        # paths.
        warm = f"warm-{uuid.uuid4().hex[:6]}"
        project_episodes(store, record(store, tokenizer, warm, 4 * args.jobs, 1))
        for from_projection in (True, False):
            derive_dataset(store, f"warm-{from_projection}", [warm], rules,
                           from_projection=from_projection)
            derive_dataset(store, f"warm-pool-{from_projection}", [warm], rules, pool=pool,
                           batch=1, from_projection=from_projection)
        for r in range(args.rounds):
            run_id = f"bench-{r}-{uuid.uuid4().hex[:6]}"
            ids = record(store, tokenizer, run_id, args.episodes, args.turns)
            for i in range(0, len(ids), 50):
                project_episodes(store, ids[i:i + 50])
            n_events = sum(len(store.read_stream(ep)) for ep in ids)
            best = {k: float("inf") for k in ("read", *kinds)}
            read_cpu = one_cpu = replay_one_cpu = float("inf")
            hashes = set()
            for k in range(args.repeat):
                t0, c0 = time.perf_counter(), time.process_time()
                for ep in ids:
                    store.read_stream(ep)
                best["read"] = min(best["read"], time.perf_counter() - t0)
                read_cpu = min(read_cpu, time.process_time() - c0)
                for kind in kinds:
                    replay = kind.startswith("replay")
                    t0, c0 = time.perf_counter(), time.process_time()
                    derived = derive_dataset(
                        store, f"d-{kind}-{r}-{k}", [run_id], rules,
                        pool=pool if kind.endswith("2p") else None,
                        from_projection=not replay)
                    best[kind] = min(best[kind], time.perf_counter() - t0)
                    if kind == "1p":
                        one_cpu = min(one_cpu, time.process_time() - c0)
                    elif kind == "replay_1p":
                        replay_one_cpu = min(replay_one_cpu, time.process_time() - c0)
                    # The same rules over the same events: the same rows, whichever way.
                    assert derived.created and derived.episodes == args.episodes, derived
                    want = args.episodes if projected_path and not replay else 0
                    assert derived.from_projection == want, (kind, derived)
                    hashes.add(derived.version.content_hash)
                    rows = derived.version.num_rows
            assert len(hashes) == 1, hashes
            for kind in kinds:
                ratios[kind].append(best["read"] / best[kind])
            cpu.append(read_cpu / one_cpu)
            replay_cpu.append(read_cpu / replay_one_cpu)
            n = len(ids)
            print(f"  round {r + 1}: plain read {n / best['read']:7.1f} episodes/s "
                  f"({n_events / best['read']:8.1f} events/s) | derive, 1 process "
                  f"{n / best['1p']:7.1f} episodes/s (ratio {ratios['1p'][-1]:.2f}) | derive, "
                  f"{args.jobs} processes {n / best['2p']:7.1f} episodes/s "
                  f"(ratio {ratios['2p'][-1]:.2f}) | replaying every episode: 1 process "
                  f"{ratios['replay_1p'][-1]:.2f}, {args.jobs} processes "
                  f"{ratios['replay_2p'][-1]:.2f} | CPU of this process per episode: read "
                  f"{read_cpu / n * 1e3:.2f} ms, derive {one_cpu / n * 1e3:.2f} ms, "
                  f"replaying {replay_one_cpu / n * 1e3:.2f} ms | {rows} rows")
        store.close()

    def verdict(ratio: float, target: float) -> str:
        return f"{ratio:.2f} ({'met' if ratio >= target else 'not met'})"

    m = {k: statistics.median(v) for k, v in ratios.items()}
    mc, mrc = statistics.median(cpu), statistics.median(replay_cpu)
    path = "projection" if projected_path else "replay"
    print(f"{args.episodes} episodes x {args.turns} turns per round"
          f"{' (last turn only)' if args.last_turn else ''}"
          f"{' (re-scored by a reward function)' if args.rescore else ''}, "
          f"fastest of {args.repeat}; median "
          f"derive/read ({path}): one process "
          f"{verdict(m['1p'], 0.5)} against 0.5, {args.jobs} processes {verdict(m['2p'], 1.0)} "
          f"against 1.0; replaying every episode: one process {verdict(m['replay_1p'], 0.5)}, "
          f"{args.jobs} processes {verdict(m['replay_2p'], 1.0)}")
    print(f"RESULT derive_vs_read_1p={m['1p']:.3f} derive_vs_read_2p={m['2p']:.3f} "
          f"replay_derive_vs_read_1p={m['replay_1p']:.3f} "
          f"replay_derive_vs_read_2p={m['replay_2p']:.3f} "
          f"derive_vs_read_1p_cpu={mc:.3f} replay_derive_vs_read_1p_cpu={mrc:.3f} "
          f"path={path} jobs={args.jobs} episodes={args.episodes} turns={args.turns} "
          f"repeat={args.repeat} rules={'rescore' if args.rescore else 'recorded'}")
    return m


if __name__ == "__main__":
    main()
