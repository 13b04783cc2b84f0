"""Benchmark: the agent loop, sequential against concurrent, against the engine's ceiling.

One process, one tiny Qwen3 model (built locally from a seed), the same torch thread count
for every measurement and, per engine, the same engine object throughout. For each engine
(vLLM's async engine on the CPU, and transformers with its padded-batch scheduler):

1. the sequential loop: E arithmetic episodes played one after the other (one episode in
   flight), with an in-memory sink;
2. the concurrent loop: the same E episodes (same tasks, same per-episode seeds) with at most
   1, 8, 32 and 64 episodes in flight at once;
3. the ceiling: the engine alone, the E first-turn prompts generated in one batch with
   ``max_tokens`` M, no loop, no tools, no store;
4. recording: the concurrent loop at the highest concurrency writing to the real
   ``EventStore`` (a scratch database on the configured server, or the embedded one) against
   the in-memory sink.

Throughput is generated tokens per second. Ratios: concurrent at the highest concurrency over
the sequential loop, and over the ceiling; the recording overhead is
``1 - median over rounds of tokens/s(store) / tokens/s(memory)``, the store run next to
the in-memory one in each round. Every round (``--repeats`` of them, 4 by default)
measures every arm once, in turn, odd rounds in the reverse order, so the drift of a shared,
noisy machine and what one arm leaves behind (the database's background work after a store
run) weigh on both sides of each pair; each arm keeps its best round. The paired ratios'
range is printed with their median.

That overhead is wall time, so on a machine with few cores it also measures how the
recording's work competes with the loop and the engine for them. What the recording costs
on its own is reported beside it, as CPU milliseconds per event recorded (medians over the
rounds): the CPU time the store's writing threads spent in append transactions
(validation, encoding, the driver: ``AppendBatcher.cpu_seconds``), and that of the
PostgreSQL server processes serving the scratch database (read from ``/proc``; absent where
the server is not on this host). This process's CPU time in the store run less that of the
in-memory run it is paired with is printed too (it also holds whatever the loop does
differently meanwhile, so it is noisier), the in-memory run's own process CPU per event for
scale, and the recording's share: the writing threads' and the server's CPU over
everything the machine's processors did during the in-memory run (``/proc/stat``: the
loop, the engine's processes, the rest), a figure noise moves far less than the wall-time
overhead. Where the cores are few and all busy, the wall-time overhead is a multiple of
that share: the recording's CPU is taken from the loop's process and the engine, and a
loop that falls behind leaves the engine smaller batches.
The last line is machine-readable, for the first engine measured (vLLM when importable):

    RESULT concurrent_vs_sequential=<x> concurrent_vs_engine=<x> recording_overhead=<f>

    python bench/rollout.py                               # E=128, M=64, both engines
    python bench/rollout.py --episodes 8 --concurrency 1,8 --no-vllm --max-tokens 16
    python bench/rollout.py --recording-only --repeats 5  # the store against memory only
    python bench/rollout.py --recording-only --eager      # ... and against eager transactions
    python bench/rollout.py --recording-only --compare-interval 50  # ... or another spacing

On a GPU, ``--device cuda --model qwen3-0.6b`` measures a real-size model instead of the tiny
one: Qwen3's shape and its real tokenizer, random weights (throughput does not depend on
them; a random model almost never ends a turn or calls a tool, so its episodes are one
``max_tokens`` call each), in bfloat16:

    python bench/rollout.py --device cuda --model qwen3-0.6b --episodes 64 --repeats 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from store.events import RunConfig, RunCreated  # noqa: E402
from workers.engines.backend import GenerationRequest, SamplingParams  # noqa: E402
from workers.engines.tinymodel import tiny_model_path  # noqa: E402
from workers.rollout.agent_tasks import arithmetic_tasks  # noqa: E402
from workers.rollout.aio import generate_async  # noqa: E402
from workers.rollout.builtin_tools import default_tool_registry  # noqa: E402
from workers.rollout.loop import arun_episode  # noqa: E402
from workers.rollout.sink import ListSink  # noqa: E402
from workers.rollout.tool_runner import ToolRunner  # noqa: E402

__all__ = ["main"]

# Qwen3's published shapes (config.json of each size): hidden, MLP, layers, query heads, key/
# value heads. Every size has head_dim 128, vocabulary 151936 and tied embeddings up to 4B.
_QWEN3_SHAPES = {
    "qwen3-0.6b": (1024, 3072, 28, 16, 8),
    "qwen3-1.7b": (2048, 6144, 28, 16, 8),
    "qwen3-4b": (2560, 9728, 36, 32, 8),
}


def _model_folder(name: str, data_dir: Path) -> Path:
    """The model the bench runs: the tiny model, or a Qwen3 shape with random weights and
    Qwen3's tokenizer, saved once under ``data_dir`` in bfloat16."""
    if name == "tiny":
        return tiny_model_path(data_dir)
    folder = data_dir / f"{name}-random"
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    from workers.engines.tokenizers import qwen3_tokenizer_dir

    hidden, mlp, layers, heads, kv_heads = _QWEN3_SHAPES[name]
    tokenizer = AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir()), local_files_only=True)
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>"),
           tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    config = Qwen3Config(
        vocab_size=151_936, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=128,
        max_position_embeddings=40_960, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        bos_token_id=None, eos_token_id=eos[0], pad_token_id=eos[1], dtype="bfloat16",
        architectures=["Qwen3ForCausalLM"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=eos[1],
                                               do_sample=True, temperature=1.0, top_p=1.0,
                                               top_k=0)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def _sampling(max_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed)


async def _play(backend: Any, sink: Any, *, episodes: int, in_flight: int, max_tokens: int,
                run_id: str, runner: ToolRunner, server: Any = None) -> dict[str, float]:
    """Play the benchmark's episodes with at most ``in_flight`` at once."""
    tools = default_tool_registry()
    tasks = arithmetic_tasks(episodes, seed=2)
    gate = asyncio.Semaphore(in_flight)
    results = []

    async def one(index: int) -> None:
        results.append(await arun_episode(
            task=tasks[index], backend=backend, tools=tools, sink=sink, run_id=run_id,
            sampling=_sampling(max_tokens, index), episode_id=str(uuid.uuid4()),
            max_turns=4, tool_runner=runner, gate=gate))

    server_before = server.cpu_seconds() if server is not None else None
    machine = _machine_cpu_seconds()
    writer = _writer_cpu_seconds(sink)
    cpu = time.process_time()
    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(episodes)))
    seconds = time.perf_counter() - started
    cpu = time.process_time() - cpu
    machine_after = _machine_cpu_seconds()
    tokens = sum(r.generated_tokens for r in results)
    run = {"in_flight": in_flight, "episodes": episodes, "seconds": seconds,
           "tokens": tokens, "llm_calls": sum(r.llm_calls for r in results),
           "errors": sum(1 for r in results if r.status == "error"),
           "tokens_per_s": tokens / seconds, "episodes_per_s": episodes / seconds,
           "process_cpu_s": cpu,
           "machine_cpu_s": (None if machine is None or machine_after is None
                             else machine_after - machine)}
    if isinstance(sink, ListSink):
        run["events"] = sum(len(events) for events in sink.streams.values())
    if server is not None:
        run["events"] = server.events(run_id)
        run["writer_cpu_s"] = _writer_cpu_seconds(sink) - writer
        if server_before is not None:
            after = server.cpu_seconds()
            # A process that served the run from its start to its end; one that started
            # meanwhile (the pool grew) counts whole.
            run["server_cpu_s"] = None if after is None else sum(
                seconds - server_before.get(pid, 0.0) for pid, seconds in after.items())
    return run


def _writer_cpu_seconds(sink: Any) -> float:
    """The CPU time the store's writing threads have spent in append transactions so far
    (0 for a sink that writes no other way)."""
    batcher = getattr(sink, "append_batcher", None)
    return 0.0 if batcher is None else batcher.cpu_seconds


def _machine_cpu_seconds() -> float | None:
    """The CPU time all of the machine's processors have spent busy so far (Linux's
    ``/proc/stat``; None elsewhere)."""
    try:
        fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and waiting for I/O
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


async def _ceiling(backend: Any, *, episodes: int, max_tokens: int) -> dict[str, float]:
    """The engine alone: the first-turn prompts in one batch."""
    tasks = arithmetic_tasks(episodes, seed=2)
    requests = [GenerationRequest(sampling=_sampling(max_tokens, i), messages=task.messages,
                                  tools=task.tools) for i, task in enumerate(tasks)]
    started = time.perf_counter()
    results = await asyncio.gather(*(generate_async(backend, r) for r in requests))
    seconds = time.perf_counter() - started
    tokens = sum(int(r.response_ids.shape[0]) for r in results)
    return {"requests": episodes, "seconds": seconds, "tokens": tokens,
            "tokens_per_s": tokens / seconds}


def _measure(name: str, backend: Any, args: argparse.Namespace, store: Any) -> dict[str, Any]:
    runner = ToolRunner(workers=4, timeout_s=60)
    play = dict(episodes=args.episodes, max_tokens=args.max_tokens, runner=runner)
    asyncio.run(_play(backend, ListSink(), episodes=2, in_flight=2, max_tokens=4,
                      run_id="warm-up", runner=runner))
    top_in_flight = args.concurrency[-1]
    arms: dict[str, Any] = {}
    if not args.recording_only:
        arms["sequential"] = lambda: _play(backend, ListSink(), in_flight=1, run_id="bench",
                                           **play)
    for c in args.concurrency if not args.recording_only else [top_in_flight]:
        arms[f"concurrent-{c}"] = lambda c=c: _play(backend, ListSink(), in_flight=c,
                                                    run_id="bench", **play)
    if store is not None:  # next to the in-memory run it is compared with
        server = _Server(store)

        def stored(sink: Any) -> Any:
            run_id = f"bench-{uuid.uuid4().hex[:8]}"
            store.append(f"run-{run_id}", [RunCreated(run_id=run_id, config=RunConfig())])
            return _play(backend, sink, in_flight=top_in_flight, run_id=run_id,
                         server=server, **play)

        arms["store"] = lambda: stored(store)
        if args.compare_interval is not None:
            other = _SpacedStore(store, args.compare_interval)
            arms["store-other"] = lambda: stored(other)
    if not args.recording_only:
        arms["ceiling"] = lambda: _ceiling(backend, episodes=args.episodes,
                                           max_tokens=args.max_tokens)
    # Every round measures every arm, odd rounds in the reverse order, so a drifting machine
    # and what one arm leaves behind (the database's background work after a store run)
    # weigh on each arm of a pair from both sides; each arm keeps its best round.
    runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
    for round_ in range(args.repeats):
        for arm in (list(arms) if round_ % 2 == 0 else list(reversed(arms))):
            runs[arm].append(asyncio.run(arms[arm]()))
            print(f"  round {round_ + 1} {arm}: {runs[arm][-1]['tokens_per_s']:.1f} tokens/s",
                  file=sys.stderr, flush=True)

    def best(name: str) -> dict[str, float]:
        return max(runs[name], key=lambda run: run["tokens_per_s"])

    if args.recording_only:
        report: dict[str, Any] = {"concurrent": [best(f"concurrent-{top_in_flight}")],
                                  "ratios": {"concurrent_vs_sequential": float("nan"),
                                             "concurrent_vs_engine": float("nan")}}
    else:
        report = {
            "sequential": best("sequential"),
            "concurrent": [best(f"concurrent-{c}") for c in args.concurrency],
            "ceiling": best("ceiling"),
        }
        report["ratios"] = {
            "concurrent_vs_sequential": (report["concurrent"][-1]["tokens_per_s"]
                                         / report["sequential"]["tokens_per_s"]),
            "concurrent_vs_engine": (report["concurrent"][-1]["tokens_per_s"]
                                     / report["ceiling"]["tokens_per_s"]),
        }
    top = report["concurrent"][-1]
    if store is not None:
        # Paired within each round (the store run follows the in-memory one), the median
        # of the rounds: one slow round of either arm does not decide it.
        memory = runs[f"concurrent-{top_in_flight}"]
        ratios = [s["tokens_per_s"] / m["tokens_per_s"]
                  for s, m in zip(runs["store"], memory, strict=True)]
        report["recording"] = {"memory": memory, "store": runs["store"],
                               "overhead": 1.0 - statistics.median(ratios),
                               "overhead_range": [1.0 - max(ratios), 1.0 - min(ratios)],
                               **_recording_cpu(memory, runs["store"])}
        if "store-other" in runs:
            other_ratios = [s["tokens_per_s"] / m["tokens_per_s"]
                            for s, m in zip(runs["store-other"], memory, strict=True)]
            report["recording"]["compared"] = {
                "interval_ms": args.compare_interval, "store": runs["store-other"],
                "overhead": 1.0 - statistics.median(other_ratios),
                **_recording_cpu(memory, runs["store-other"])}
    runner.close()
    seq = report.get("sequential")
    if seq is not None:
        print(f"{name:12s} sequential        {seq['tokens_per_s']:8.1f} tokens/s  "
              f"{seq['episodes_per_s']:6.2f} episodes/s")
    for row in report["concurrent"]:
        speedup = "" if seq is None else f"  (x{row['tokens_per_s'] / seq['tokens_per_s']:.2f})"
        print(f"{name:12s} {row['in_flight']:3d} in flight      {row['tokens_per_s']:8.1f} "
              f"tokens/s  {row['episodes_per_s']:6.2f} episodes/s{speedup}")
    if "ceiling" in report:
        print(f"{name:12s} engine alone      {report['ceiling']['tokens_per_s']:8.1f} tokens/s")
    if "recording" in report:
        recording = report["recording"]
        low, high = recording["overhead_range"]
        print(f"{name:12s} recording overhead {recording['overhead']:+.3f} "
              f"(EventStore against memory, {top['in_flight']} in flight; median of "
              f"{len(recording['store'])} paired rounds, from {low:+.3f} to {high:+.3f})")
        server_ms = recording["server_cpu_ms_per_event"]
        print(f"{name:12s} recording CPU      {recording['writer_cpu_ms_per_event']:.3f} ms/event "
              f"in the writing thread + "
              + ("n/a" if server_ms is None else f"{server_ms:.3f}")
              + f" ms/event in PostgreSQL; this process "
              f"{recording['process_cpu_ms_per_event']:+.3f} ms/event against the in-memory run "
              f"(whose loop used {recording['loop_cpu_ms_per_event']:.3f} ms/event)")
        if recording["cpu_share"] is not None:
            print(f"{name:12s} recording share   {recording['cpu_share']:.3f} of the CPU the "
                  f"in-memory run kept busy ({recording['machine_cpu_ms_per_event']:.3f} "
                  f"ms/event on the whole machine)")
        if "compared" in recording:
            own = store.settings.append_interval_ms
            for ms, row in ((own, recording), (args.compare_interval, recording["compared"])):
                server_ms = row["server_cpu_ms_per_event"]
                print(f"{name:12s} {ms:4d} ms spacing  overhead {row['overhead']:+.3f}, "
                      f"{row['writer_cpu_ms_per_event']:.3f} + "
                      + ("n/a" if server_ms is None else f"{server_ms:.3f}")
                      + " ms/event (writing thread + PostgreSQL)")
    return report


def _recording_cpu(memory: list[dict[str, Any]], stored: list[dict[str, Any]]
                   ) -> dict[str, float | None]:
    """The recording's CPU per event (module docstring), medians over the paired rounds."""
    process = [(s["process_cpu_s"] - m["process_cpu_s"]) * 1000 / s["events"]
               for s, m in zip(stored, memory, strict=True)]
    writer = [s["writer_cpu_s"] * 1000 / s["events"] for s in stored]
    server = [s["server_cpu_s"] * 1000 / s["events"] for s in stored
              if s.get("server_cpu_s") is not None]
    machine = [m["machine_cpu_s"] * 1000 / m["events"] for m in memory
               if m.get("machine_cpu_s") is not None]
    report: dict[str, float | None] = {
        "process_cpu_ms_per_event": statistics.median(process),
        "writer_cpu_ms_per_event": statistics.median(writer),
        "server_cpu_ms_per_event": statistics.median(server) if server else None,
        "loop_cpu_ms_per_event": statistics.median(
            m["process_cpu_s"] * 1000 / m["events"] for m in memory),
        "machine_cpu_ms_per_event": statistics.median(machine) if machine else None,
        "cpu_share": None,
    }
    if server and machine and report["machine_cpu_ms_per_event"]:
        # What the recording adds, over all the CPU the in-memory run kept busy (the loop,
        # the engine, everything else on the machine): its share of the work, which noise
        # moves far less than wall time.
        report["cpu_share"] = ((report["writer_cpu_ms_per_event"]
                                + report["server_cpu_ms_per_event"])
                               / report["machine_cpu_ms_per_event"])
    return report


class _SpacedStore:
    """The store with its shared append transactions spaced ``interval_ms`` apart instead of
    the configured ``append_interval_ms`` (0: each as soon as the one before it is done)."""

    def __init__(self, store: Any, interval_ms: int) -> None:
        from store.append_batcher import AppendBatcher

        self.store = store
        self.append_batcher = AppendBatcher(store, interval_s=interval_ms / 1000)

    def append(self, stream_id: str, events: Any, expected_version: Any = "any") -> Any:
        return self.store.append(stream_id, events, expected_version)

    async def aappend(self, stream_id: str, events: Any, expected_version: Any = "any") -> Any:
        return await self.append_batcher.append(stream_id, events, expected_version)


class _Server:
    """The PostgreSQL processes serving the store's database: their CPU time (Linux, server
    on this host) and what a run stored."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def events(self, run_id: str) -> int:
        with self.store.db.connection() as conn:
            return int(conn.execute("SELECT count(*) FROM events WHERE run_id = %s",
                                    (run_id,)).fetchone()[0])

    def cpu_seconds(self) -> dict[int, float] | None:
        """The CPU time so far of each server process connected to the store's database
        (None when they cannot be read)."""
        with self.store.db.connection() as conn:
            pids = [row[0] for row in conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            ).fetchall()]
        ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        seconds = {}
        for pid in pids:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                return None
            fields = stat[stat.rindex(")") + 2:].split()
            seconds[pid] = (int(fields[11]) + int(fields[12])) / ticks
        return seconds


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark and print (and return) its numbers."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1,8,32,64",
                        help="episodes in flight, comma separated (the last is compared)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="where the tiny model is cached (a temporary folder by default)")
    parser.add_argument("--no-vllm", action="store_true", help="measure transformers only")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda[:n] (transformers)")
    parser.add_argument("--model", default="tiny", choices=["tiny", *_QWEN3_SHAPES],
                        help="the tiny model, or a Qwen3 shape with random weights")
    parser.add_argument("--no-store", action="store_true",
                        help="skip the recording measurement (no database)")
    parser.add_argument("--recording-only", action="store_true",
                        help="measure only the recording: the in-memory and store runs at the "
                             "highest concurrency (the RESULT ratios are then nan)")
    parser.add_argument("--compare-interval", type=int, default=None, metavar="MS",
                        help="also measure the store with its shared transactions spaced MS "
                             "milliseconds apart (0-1000), paired the same way")
    parser.add_argument("--eager", action="store_true",
                        help="--compare-interval 0: each shared transaction written as soon "
                             "as the last is done")
    args = parser.parse_args(argv)
    if args.eager:
        if args.compare_interval not in (None, 0):
            parser.error("--eager is --compare-interval 0: give one or the other")
        args.compare_interval = 0
    if args.compare_interval is not None and args.no_store:
        parser.error("--compare-interval and --eager measure the store: they cannot go with "
                     "--no-store")
    if args.compare_interval is not None and not 0 <= args.compare_interval <= 1000:
        parser.error(f"--compare-interval must be 0-1000 ms, got {args.compare_interval}")
    if args.recording_only and args.no_store:
        parser.error("--recording-only measures the store: it cannot go with --no-store")
    for name in ("episodes", "max_tokens", "threads", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        parser.error(f"--concurrency must be integers separated by commas, "
                     f"got {args.concurrency!r}")
    if not args.concurrency or min(args.concurrency) < 1:
        parser.error("--concurrency values must be >= 1")

    if args.device != "cpu" and not args.device.startswith("cuda"):
        parser.error(f"--device must be cpu or cuda[:n], got {args.device!r}")
    dtype = "float32" if args.model == "tiny" else "bfloat16"
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    model_dir = _model_folder(args.model, data_dir)
    import torch

    from workers.engines.backend_transformers import TransformersBackend
    from workers.engines.backend_vllm import cpu_engine_environment, vllm_available

    report: dict[str, Any] = {"episodes": args.episodes, "max_tokens": args.max_tokens,
                              "threads": args.threads, "engines": {}}
    if not args.no_vllm and args.device == "cpu":
        # before vllm is first imported: a CPU engine with a bounded cache
        os.environ.update(cpu_engine_environment(data_dir / "vllm-cache"))
    use_vllm = not args.no_vllm and vllm_available()
    print(f"{args.model} Qwen3 on {args.device}, {args.episodes} arithmetic episodes, "
          f"max_tokens {args.max_tokens}, {args.threads} torch threads")
    with _store(args) as store:
        if use_vllm:
            from workers.engines.backend_vllm import AsyncVLLMBackend

            engine = AsyncVLLMBackend(model_dir, distributed_executor_backend="uni",
                                      enforce_eager=args.device == "cpu", dtype=dtype,
                                      max_model_len=2048, seed=0,
                                      enable_chunked_prefill=False)
            try:
                report["engines"]["vllm"] = _measure("vLLM", engine, args, store)
            finally:
                engine.close()
        else:
            reason = "--no-vllm given" if args.no_vllm else "vllm is not importable"
            print(f"vLLM not measured ({reason})")
        torch.set_num_threads(args.threads)
        hf = TransformersBackend(model_dir, max_batch=max(args.concurrency),
                                 device=args.device, dtype=getattr(torch, dtype))
        try:
            report["engines"]["transformers"] = _measure("transformers", hf, args, store)
        finally:
            hf.close()
    first = next(iter(report["engines"].values()))
    ratios = first["ratios"]
    overhead = first.get("recording", {}).get("overhead", float("nan"))
    print(json.dumps(report, indent=2))
    print(f"RESULT concurrent_vs_sequential={ratios['concurrent_vs_sequential']:.2f} "
          f"concurrent_vs_engine={ratios['concurrent_vs_engine']:.2f} "
          f"recording_overhead={overhead:.3f}")
    return report


class _store:
    """The EventStore over a scratch database (None with ``--no-store``)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.scratch: Any = None
        self.store: Any = None

    def __enter__(self) -> Any:
        if self.args.no_store:
            return None
        from bench.common import scratch_database
        from store.eventlog import EventStore
        from store.settings import Settings

        self.scratch = scratch_database()
        url = self.scratch.__enter__()
        self.store = EventStore.open(Settings(database_url=url), migrate=False)
        return self.store

    def __exit__(self, *exc: object) -> None:
        if self.store is not None:
            self.store.close()
        if self.scratch is not None:
            self.scratch.__exit__(None, None, None)


if __name__ == "__main__":
    main()
