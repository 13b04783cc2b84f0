"""Replay latency: time from an ``episode_finished`` append to the episode's samples, with a
real Celery replay worker, for episodes appended by a process that queues nothing (as the REST
API, the gateway and remote rollout append), against a baseline measured in the same run.

Baseline (a): the appender queues ``replay_episode`` itself right after the commit (what only
rollout workers used to do). Measured (b): the appender only appends; the replay worker's
follower of the log queues the replay. Episodes alternate between (a) and (b); both are
timed from the return of the append to the moment the episode's projection is visible.

    python bench/replay_latency.py [--episodes 20 --turns 3]

Ends with ``RESULT replay_latency_median_s=<b> follower_vs_direct=<b/a>``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import scratch_database  # noqa: E402
from bench.replay import episode  # noqa: E402
from store import embedded  # noqa: E402
from store.db import Database  # noqa: E402
from store.eventlog import NO_STREAM, EventStore, run_stream_id  # noqa: E402
from store.events import RunConfig, RunCreated  # noqa: E402
from store.projections import Projections  # noqa: E402
from store.settings import Settings  # noqa: E402
from workers.engines.tokenizers import load_tokenizer  # noqa: E402


def _wait_ready(log: Path, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if b" ready." in log.read_bytes():
            return
        if proc.poll() is not None:
            raise RuntimeError(f"the replay worker exited: {log.read_text()[-2000:]}")
        time.sleep(0.1)
    raise RuntimeError("the replay worker did not start")


def _time_to_projection(projections: Projections, episode_id: str, since: float,
                        timeout: float = 60) -> float:
    while time.monotonic() - since < timeout:
        if projections.projected_version(episode_id):
            return time.monotonic() - since
        time.sleep(0.005)
    raise RuntimeError(f"{episode_id} was not projected within {timeout} s")


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=20, help="Episodes per arm.")
    parser.add_argument("--turns", type=int, default=3, help="LLM calls per episode.")
    args = parser.parse_args(argv)
    if args.episodes < 1 or args.turns < 1:
        parser.error("--episodes and --turns must be >= 1")
    tokenizer = load_tokenizer("qwen3")
    # The broker stops before its folder is removed (it would run on, with nowhere to save).
    with tempfile.TemporaryDirectory() as tmp, scratch_database() as url, \
            embedded.scoped_redis_url(Settings(database_url=url, data_dir=Path(tmp))) as broker:
        settings = Settings(database_url=url, data_dir=Path(tmp))
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
        env.update(TRAJSTORE_DATABASE_URL=url, TRAJSTORE_REDIS_URL=broker,
                   TRAJSTORE_DATA_DIR=tmp)
        from workers.app import app, configure

        configure(app, Settings(database_url=url, redis_url=broker, data_dir=Path(tmp)))
        store = EventStore(Database(url, max_size=2), settings)
        run_id = f"latency-{uuid.uuid4().hex[:8]}"
        store.append(run_stream_id(run_id), [RunCreated(
            run_id=run_id, config=RunConfig(group_size=1, tokenizer="qwen3"))], NO_STREAM)
        log = Path(tmp) / "worker.log"
        with open(log, "ab") as out:
            worker = subprocess.Popen(
                [sys.executable, "-m", "trajstore", "worker", "--queues", "replay"],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        projections = Projections(store)
        direct: list[float] = []
        follower: list[float] = []
        try:
            _wait_ready(log, worker)
            # One warm-up episode: the worker's first replay loads the tokenizer.
            warm = f"warm-{uuid.uuid4().hex[:8]}"
            store.append(warm, episode(tokenizer, run_id, "warm", args.turns, 0))
            _time_to_projection(projections, warm, time.monotonic(), timeout=120)
            for i in range(2 * args.episodes):
                episode_id = f"ep-{i}-{uuid.uuid4().hex[:8]}"
                events = episode(tokenizer, run_id, f"g{i}", args.turns, i + 1)
                store.append(episode_id, events, NO_STREAM)
                start = time.monotonic()
                if i % 2 == 0:
                    app.send_task("trajstore.replay_episode", args=[episode_id],
                                  queue="replay")
                    direct.append(_time_to_projection(projections, episode_id, start))
                else:
                    follower.append(_time_to_projection(projections, episode_id, start))
        finally:
            os.killpg(worker.pid, 15)
            worker.wait(timeout=60)
            store.close()
    a, b = statistics.median(direct), statistics.median(follower)
    print(f"episodes per arm: {args.episodes}, {args.turns} LLM calls each")
    print(f"(a) appender queues the replay itself: median {a * 1000:.0f} ms, "
          f"p90 {statistics.quantiles(direct, n=10)[-1] * 1000:.0f} ms")
    print(f"(b) the log's follower queues it:      median {b * 1000:.0f} ms, "
          f"p90 {statistics.quantiles(follower, n=10)[-1] * 1000:.0f} ms")
    print(f"RESULT replay_latency_median_s={b:.3f} follower_vs_direct={b / a:.2f}")
    return {"direct": a, "follower": b}


if __name__ == "__main__":
    main()
