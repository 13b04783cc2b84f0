"""API benchmark: HTTP batch append against direct ``store.append``, and episode query
latency under concurrent clients, in one run against a real ``trajstore serve`` process.

1. Append: episodes of ``--batch-events`` events (``episode_started``, LLM calls whose
   prompts grow turn by turn, tool results, reward, finish) are appended one episode per
   call, in turn three ways: ``EventStore.append`` of event models built beforehand (their
   validation is not timed), ``EventStore.append`` of plain mappings (the store validates
   them, as it must for what arrives over HTTP), and HTTP batches (token payloads base64 or
   JSON lists, ``--encoding``; each prompt by reference to the previous call, or in full
   with ``--no-prompt-refs``). Prints events/s and the HTTP/direct ratio against both direct
   forms per round; target: HTTP >= 0.5x direct.
2. Queries: ``--events`` events (``--episode-events`` per episode, spread over ``--runs``
   runs) are loaded straight into the store, then ``--clients`` concurrent clients send
   ``--queries`` requests of each kind: one episode with its events (without and with token
   payloads), a page of a run's episodes, a filtered page. Prints p50/p99 latency and
   requests/s per kind.

    python bench/api.py [--events 1000000 --clients 32 --queries 2000 --workers 1]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from api.keys import KeyStore  # noqa: E402
from bench.common import scratch_database  # noqa: E402
from store.db import Database  # noqa: E402
from store.eventlog import EventStore, run_stream_id  # noqa: E402
from store.events import (  # noqa: E402
    EpisodeFinished,
    EpisodeStarted,
    Event,
    LLMCalled,
    RewardAssigned,
    RunConfig,
    RunCreated,
    ToolReturned,
)
from store.settings import Settings  # noqa: E402

__all__ = ["batch_json", "episode_events", "main", "to_json", "run_append", "run_queries"]


def episode_events(*, run_id: str, group_id: str, n_events: int, prompt: int,
                   response: int, seed: int) -> list[Event]:
    """One finished episode of ``n_events`` events (at least 5): started, alternating LLM
    calls and tool results, reward, finished. Each call's prompt is the previous prompt,
    its generation and ``prompt`` new tokens, as a multi-turn agent's prompts are."""
    if n_events < 5:
        raise ValueError(f"n_events must be >= 5, got {n_events}")
    rng = np.random.default_rng(seed)
    events: list[Event] = [EpisodeStarted(run_id=run_id, group_id=group_id, task_id="t",
                                          event_id=uuid.uuid4())]
    ids = rng.integers(0, 150_000, prompt).astype(np.int32)
    turn = 0
    while len(events) < n_events - 2:
        out = rng.integers(0, 150_000, response).astype(np.int32)
        events.append(LLMCalled(
            event_id=uuid.uuid4(), call_id=f"c{turn}",
            messages=[{"role": "user", "content": f"step {turn}"}], prompt_ids=ids,
            response_ids=out, logprobs=(-rng.random(response)).astype(np.float32),
            response={"role": "assistant", "content": f"calling tool {turn}"},
            finish_reason="stop", latency_ms=12.0))
        if len(events) < n_events - 2:
            events.append(ToolReturned(event_id=uuid.uuid4(), name="calculator",
                                       arguments={"expression": f"{turn} + 1"},
                                       output=str(turn + 1), duration_ms=1.0))
        ids = np.concatenate([ids, out, rng.integers(0, 150_000, prompt).astype(np.int32)])
        turn += 1
    events.append(RewardAssigned(event_id=uuid.uuid4(), value=float(rng.integers(0, 2))))
    events.append(EpisodeFinished(event_id=uuid.uuid4(), status="completed"))
    return events


def to_json(event: Event, *, encoding: str) -> dict[str, Any]:
    """An event as the HTTP batch carries it."""
    body = {"type": event.type, "event_id": str(event.event_id), **event.to_data()}
    for name, arr in event.token_payloads().items():
        dtype = "<f4" if name == "logprobs" else "<i4"
        body[name] = (base64.b64encode(np.ascontiguousarray(arr, dtype=dtype).tobytes())
                      .decode() if encoding == "base64" else arr.tolist())
    return body


def batch_json(events: list[Event], *, encoding: str, prompt_refs: bool) -> list[dict[str, Any]]:
    """A batch as the HTTP API takes it; with ``prompt_refs`` each LLM call whose prompt
    extends the previous call's prompt and generation sends only the new tokens."""
    out = []
    base: np.ndarray | None = None
    base_index = -1
    for i, event in enumerate(events):
        body = to_json(event, encoding=encoding)
        if prompt_refs and isinstance(event, LLMCalled):
            prompt = event.prompt_ids
            if base is not None and len(prompt) >= len(base) and \
                    np.array_equal(prompt[: len(base)], base):
                suffix = np.ascontiguousarray(prompt[len(base):], dtype="<i4")
                body["prompt_ids"] = {"extends": base_index, "suffix": (
                    base64.b64encode(suffix.tobytes()).decode() if encoding == "base64"
                    else suffix.tolist())}
            base = np.concatenate([prompt, event.response_ids])
            base_index = i
        out.append(body)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Server:
    def __init__(self, url: str, *, workers: int, log: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
        env.update(TRAJSTORE_DATABASE_URL=url, TRAJSTORE_LOG_LEVEL="WARNING",
                   TRAJSTORE_POOL_MAX_SIZE="16",
                   TRAJSTORE_API_MAX_REQUEST_BYTES=str(256 * 1024 * 1024))
        self._log = open(log, "ab")
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trajstore", "serve", "--host", "127.0.0.1", "--port",
             str(self.port), "--workers", str(workers)],
            env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server did not start: {log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        self._log.close()


def _in_threads(work: list[Any], fn: Any, threads: int) -> float:
    """Seconds to run ``fn`` on every item of ``work`` with ``threads`` threads."""
    import gc
    from concurrent.futures import ThreadPoolExecutor

    # The bench process holds every prepared batch: keep its garbage collector out of the
    # timing (this favours the direct side, which runs in this process).
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        if threads == 1:
            for item in work:
                fn(item)
        else:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(fn, work))
        return time.perf_counter() - t0
    finally:
        gc.enable()


def _as_mapping(event: Event) -> dict[str, Any]:
    """The event as a plain mapping (token payloads as numpy arrays), as a caller that
    has not built models hands it to ``store.append``."""
    return {"type": event.type, "event_id": event.event_id, **event.to_data(),
            **event.token_payloads()}


def run_append(store: EventStore, server_url: str, token: str, *, run_id: str,
               episodes: int, batch_events: int, prompt: int, response: int, encoding: str,
               rounds: int, clients: int = 1, warmup: int = 1, prompt_refs: bool = True
               ) -> dict[str, list[float]]:
    """Alternate three ways of appending the same kind of episodes, ``clients`` threads
    each: ``store.append`` of event models built beforehand (no validation timed), of plain
    mappings (the store validates them, as the API must), and HTTP batches. The first
    ``warmup`` rounds are run and not counted. Returns the HTTP/direct events/s ratio per
    counted round against each."""
    import json

    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    ratios: dict[str, list[float]] = {"models": [], "mappings": []}
    with httpx.Client(base_url=server_url, headers=headers, timeout=300,
                      limits=httpx.Limits(max_connections=clients)) as http:
        def post(item: tuple[str, bytes]) -> None:
            r = http.post(f"/v1/episodes/{item[0]}/events", content=item[1])
            if r.status_code != 200:
                raise RuntimeError(f"append failed: {r.status_code} {r.text[:300]}")

        def make(tag: str, i: int) -> list[Event]:
            return episode_events(run_id=run_id, group_id=f"{tag}-{i}", n_events=batch_events,
                                  prompt=prompt, response=response, seed=i)

        for rnd in range(warmup + rounds):
            models = [(f"m-{rnd}-{i}-{uuid.uuid4().hex[:6]}", make("m", i))
                      for i in range(episodes)]
            mappings = [(f"d-{rnd}-{i}-{uuid.uuid4().hex[:6]}",
                         [_as_mapping(e) for e in make("d", i)]) for i in range(episodes)]
            bodies = [(f"h-{rnd}-{i}-{uuid.uuid4().hex[:6]}", json.dumps({
                "expected_version": "no_stream",
                "events": batch_json(make("h", i), encoding=encoding,
                                     prompt_refs=prompt_refs)}).encode())
                for i in range(episodes)]
            n = episodes * batch_events

            def direct(item: tuple[str, list[Any]]) -> None:
                store.append(item[0], item[1], "no_stream")

            runs: list[tuple[str, list[Any], Any]] = [
                ("models", models, direct), ("maps", mappings, direct), ("http", bodies, post)]
            if clients == 1:
                # Interleave one episode of each kind at a time, the order rotating, so that
                # all three meet the same table size and the same machine load.
                took = dict.fromkeys(("models", "maps", "http"), 0.0)
                for i in range(episodes):
                    turn = runs[i % 3:] + runs[: i % 3]
                    for name, work, fn in turn:
                        took[name] += _in_threads([work[i]], fn, 1)
            else:
                took = {name: _in_threads(work, fn, clients)
                        for name, work, fn in (runs if rnd % 2 == 0 else runs[::-1])}
            t_models, t_maps, t_http = took["models"], took["maps"], took["http"]
            mb = sum(len(b) for _, b in bodies) / 1e6
            if rnd < warmup:
                continue
            ratios["models"].append(t_models / t_http)
            ratios["mappings"].append(t_maps / t_http)
            print(f"  round {rnd - warmup}: direct (models) {n / t_models:7.0f} ev/s   direct "
                  f"(mappings) {n / t_maps:7.0f} ev/s   HTTP {n / t_http:7.0f} ev/s "
                  f"({mb / t_http:5.1f} MB/s)   HTTP/direct {t_models / t_http:.2f}x, "
                  f"{t_maps / t_http:.2f}x", flush=True)
    return ratios


def load_events(store: EventStore, *, runs: list[str], total: int, per_episode: int,
                prompt: int, response: int) -> tuple[list[str], float]:
    """Append ``total`` events as finished episodes spread over ``runs``; returns the
    episode ids and the seconds it took."""
    episodes: list[str] = []
    t0 = time.perf_counter()
    count = 0
    i = 0
    while count < total:
        run_id = runs[i % len(runs)]
        n = min(per_episode, max(5, total - count))
        events = episode_events(run_id=run_id, group_id=f"g{i // 8}", n_events=n,
                                prompt=prompt, response=response, seed=i)
        episode_id = f"q-{i}-{uuid.uuid4().hex[:6]}"
        store.append(episode_id, events, "no_stream")
        episodes.append(episode_id)
        count += len(events)
        i += 1
        if i % 500 == 0:
            rate = count / (time.perf_counter() - t0)
            print(f"  loaded {count:,} events ({rate:,.0f} events/s)", flush=True)
    return episodes, time.perf_counter() - t0


async def _phase(url: str, token: str, paths: list[str], clients: int
                 ) -> tuple[list[float], float, list[str]]:
    latencies: list[float] = []
    failures: list[str] = []
    queue = list(reversed(paths))
    headers = {"Authorization": f"Bearer {token}"}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=300,
                                 limits=limits) as http:
        async def worker() -> None:
            while queue:
                path = queue.pop()
                t0 = time.perf_counter()
                try:
                    r = await http.get(path)
                except httpx.TransportError as exc:  # counted and reported, not hidden
                    failures.append(f"GET {path}: {type(exc).__name__} {exc}")
                    continue
                latencies.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    raise RuntimeError(f"GET {path}: {r.status_code} {r.text[:200]}")

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        return latencies, time.perf_counter() - t0, failures


def run_queries(url: str, token: str, *, episodes: list[str], runs: list[str],
                queries: int, clients: int, seed: int = 0) -> dict[str, dict[str, float]]:
    """p50/p99 latency (ms) and requests/s per query kind."""
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(episodes), queries)
    run_pick = rng.integers(0, len(runs), queries)
    kinds = {
        "episode (events, no tokens)": [f"/v1/episodes/{episodes[i]}?tokens=false"
                                        for i in pick],
        "episode (events + base64 tokens)": [f"/v1/episodes/{episodes[i]}?encoding=base64"
                                             for i in pick],
        "list 50 of a run": [f"/v1/episodes?run_id={runs[r]}&limit=50" for r in run_pick],
        "list 50, status + reward filter": [
            f"/v1/episodes?run_id={runs[r]}&status=completed&reward_min=0.5&limit=50"
            for r in run_pick],
    }
    out = {}
    for name, paths in kinds.items():
        latencies, wall, failures = asyncio.run(_phase(url, token, paths, clients))
        ms = np.asarray(latencies) * 1000
        out[name] = {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99)),
                     "rps": len(latencies) / wall, "failed": len(failures)}
        print(f"  {name:<36} p50 {out[name]['p50']:8.1f} ms   p99 {out[name]['p99']:8.1f} ms"
              f"   {out[name]['rps']:7.1f} req/s"
              + (f"   {len(failures)} failed, e.g. {failures[0][:160]}" if failures else ""),
              flush=True)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=20, help="episodes per append round")
    parser.add_argument("--batch-events", type=int, default=50, help="events per append call")
    parser.add_argument("--prompt", type=int, default=200, help="new prompt tokens per call")
    parser.add_argument("--response", type=int, default=100, help="generated tokens per call")
    parser.add_argument("--encoding", choices=("base64", "json"), default="base64")
    parser.add_argument("--no-prompt-refs", action="store_true",
                        help="send every prompt in full (default: by reference to the "
                             "previous call of the batch, see docs/api.md)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="append rounds not counted")
    parser.add_argument("--append-clients", type=int, default=1,
                        help="threads appending at once, on each side")
    parser.add_argument("--events", type=int, default=1_000_000,
                        help="events stored before the query phase")
    parser.add_argument("--episode-events", type=int, default=100)
    parser.add_argument("--query-prompt", type=int, default=16)
    parser.add_argument("--query-response", type=int, default=16)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--queries", type=int, default=2000, help="requests per query kind")
    parser.add_argument("--workers", type=int, default=1, help="API worker processes")
    parser.add_argument("--skip-append", action="store_true")
    parser.add_argument("--skip-queries", action="store_true")
    args = parser.parse_args(argv)

    results: dict[str, Any] = {}
    with scratch_database() as url, tempfile.TemporaryDirectory() as tmp:
        settings = Settings(database_url=url, api_key_scrypt_n=1024)
        # Four connections in turn: appends on one long-lived connection slow down over
        # time, which would flatter the HTTP side (the server spreads them over its pool).
        store = EventStore(Database(url, min_size=4, max_size=4), settings)
        token = KeyStore(store.db, settings).create(project="bench", role="admin").token
        runs = [f"bench-{i}" for i in range(args.runs)]
        for run_id in runs:
            store.append(run_stream_id(run_id), [RunCreated(
                run_id=run_id, project="bench", config=RunConfig(group_size=8))], "no_stream")
        server = _Server(url, workers=args.workers, log=Path(tmp) / "server.log")
        try:
            if not args.skip_append:
                print(f"append: {args.episodes} episodes x {args.batch_events} events per "
                      f"round, one episode per call, +{args.prompt} prompt / "
                      f"{args.response} generated tokens per LLM call, {args.encoding} "
                      f"tokens over HTTP, prompts "
                      f"{'in full' if args.no_prompt_refs else 'by reference'}, "
                      f"{args.append_clients} client thread(s) on each side, "
                      f"{args.workers} API worker(s)")
                ratios = run_append(store, server.url, token, run_id=runs[0],
                                    episodes=args.episodes, batch_events=args.batch_events,
                                    prompt=args.prompt, response=args.response,
                                    encoding=args.encoding, rounds=args.rounds,
                                    clients=args.append_clients, warmup=args.warmup,
                                    prompt_refs=not args.no_prompt_refs)
                results["append_ratio"] = statistics.median(ratios["models"])
                results["append_ratio_mappings"] = statistics.median(ratios["mappings"])
                print(f"HTTP append / direct append: median {results['append_ratio']:.2f}x "
                      f"against models built beforehand, "
                      f"{results['append_ratio_mappings']:.2f}x against mappings the store "
                      f"validates (target >= 0.5x)")
            if not args.skip_queries:
                print(f"loading {args.events:,} events ({args.episode_events} per episode, "
                      f"{args.runs} runs) straight into the store ...", flush=True)
                episodes, took = load_events(
                    store, runs=runs, total=args.events, per_episode=args.episode_events,
                    prompt=args.query_prompt, response=args.query_response)
                stored = sum(store.counts_by_type().values())
                print(f"stored {stored:,} events in {len(episodes):,} episodes "
                      f"(loaded in {took:.0f} s); {args.clients} concurrent clients, "
                      f"{args.queries} requests per kind:")
                results["stored_events"] = stored
                results["queries"] = run_queries(server.url, token, episodes=episodes,
                                                 runs=runs, queries=args.queries,
                                                 clients=args.clients)
        except BaseException:
            print(f"server exit status {server.proc.poll()}; log (tail):\n"
                  f"{server.log.read_text()[-3000:]}", file=sys.stderr)
            raise
        finally:
            server.stop()
            store.close()
    return results


if __name__ == "__main__":
    main()
