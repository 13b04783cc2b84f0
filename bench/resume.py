"""Benchmark: a rollout worker SIGKILLed while it plays 64 episodes, five times over.

Real ``trajstore worker --queues rollout`` processes (threads pool, the transformers backend
on the CPU, the tiny model), a scratch database and an embedded Redis of the bench's own, the
broker's visibility timeout left at an hour so that only the rollout workers' heartbeats
(``workers.rollout.liveness``) can bring a killed worker's groups back before it.

Each round: a replacement worker is started beside the active one; once it is ready,
``--groups`` groups of ``--group-size`` episodes of the ``arith`` task (the calculator tool;
8 × 8 = 64 episodes by default) are queued, both workers may take them, and the active worker
is SIGKILLed at a random moment (uniform in ``[0, --kill-window]`` seconds after the first
episode started, seeded) with episodes in flight.
The replacement's watcher finds the dead worker's heartbeat expired, queues its groups again
and resumes their episodes from the log; it is the active worker of the next round.

Measured, from the log:

- ``episodes_lost``: slots of the groups sent that hold no finished episode, or only an
  ``aborted`` one, at the end;
- ``tool_duplicates``: tool results recorded more than once for one tool call (a recorded
  result is taken from the log on resume; a non-idempotent call interrupted at the kill is
  answered as interrupted, not run again);
- ``regenerated_calls_per_inflight``: over the episodes in flight at a kill, LLM calls
  generated again: recorded calls stored a second time (an ``llm_called`` of one turn twice),
  plus, per episode, the one call that was being generated when the worker died (its last
  stored event was not one that waits for a tool);
- ``median_kill_to_next_event_s``: for each episode in flight at a kill, from the kill to
  the first event appended after it (``recorded_at``, the server's clock, on this host).

    python bench/resume.py                     # 5 kills, 8 groups × 8 episodes
    python bench/resume.py --kills 2 --groups 2 --group-size 4   # a quick look

The last line: ``RESULT episodes_lost=<n> tool_duplicates=<n>
regenerated_calls_per_inflight=<x> median_kill_to_next_event_s=<s>``.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import scratch_database  # noqa: E402
from store import embedded  # noqa: E402
from store.db import Database  # noqa: E402
from store.eventlog import NO_STREAM, EventStore, run_stream_id  # noqa: E402
from store.events import RolloutConfig, RunConfig, RunCreated  # noqa: E402
from store.settings import Settings  # noqa: E402
from workers.engines.tinymodel import tiny_model_path  # noqa: E402


class Worker:
    """A ``trajstore worker --queues rollout`` process in its own process group."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.log = log
        self._out = open(log, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trajstore", "worker", "--queues", "rollout"], env=env,
            stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True,
            cwd=Path(__file__).resolve().parent.parent)

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if b" ready." in self.log.read_bytes():
                return
            if self.proc.poll() is not None:
                raise SystemExit(f"worker exited: {self.log.read_text()[-2000:]}")
            time.sleep(0.2)
        raise SystemExit(f"worker not ready: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self._out.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        if not self._out.closed:
            self._out.close()


def _open_streams(store: EventStore, run_id: str) -> dict[str, tuple[int, str]]:
    """Episodes of the run started and not finished: their version and last event type."""
    with store.db.connection() as conn:
        rows = conn.execute(
            "SELECT DISTINCT ON (stream_id) stream_id, stream_version, type, data::text"
            " FROM events WHERE run_id = %s AND stream_id <> %s"
            " AND stream_id NOT IN (SELECT stream_id FROM events WHERE run_id = %s"
            " AND type = 'episode_finished')"
            " ORDER BY stream_id, stream_version DESC",
            (run_id, run_stream_id(run_id), run_id)).fetchall()
    return {r[0]: (int(r[1]), _waits_for_tool(r[2], r[3])) for r in rows}


def _waits_for_tool(event_type: str, data: str) -> str:
    """``tool`` when the episode's last event is its last LLM call's (a call that made no tool
    call ends the episode, so one that is not the last left tool calls to run: no generation
    was in flight), else ``llm``."""
    del data
    return "tool" if event_type in ("llm_called", "checkpoint_created") else "llm"


def _counted(store: EventStore, run_id: str, slots: list[tuple[str, int]]) -> dict[str, Any]:
    from workers.rollout.group import MAX_ATTEMPTS, episode_id_for

    with store.db.connection() as conn:
        finished = dict(conn.execute(
            "SELECT stream_id, data->>'status' FROM events WHERE run_id = %s"
            " AND type = 'episode_finished'", (run_id,)).fetchall())
        tool_twice = conn.execute(
            "SELECT count(*) FROM (SELECT stream_id, data->>'tool_call_id' FROM events"
            " WHERE run_id = %s AND type = 'tool_returned' GROUP BY 1, 2"
            " HAVING count(*) > 1) t", (run_id,)).fetchone()[0]  # type: ignore[index]
        call_twice = conn.execute(
            "SELECT count(*) FROM (SELECT stream_id, data->>'call_id' FROM events"
            " WHERE run_id = %s AND type = 'llm_called' AND data->>'call_id' IS NOT NULL"
            " GROUP BY 1, 2 HAVING count(*) > 1) t", (run_id,)).fetchone()[0]  # type: ignore[index]
        tools = conn.execute("SELECT count(*) FROM events WHERE run_id = %s"
                             " AND type = 'tool_returned'", (run_id,)).fetchone()[0]  # type: ignore[index]
    lost = 0
    for group_id, slot in slots:
        statuses = [finished.get(episode_id_for(group_id, slot, a)) for a in range(MAX_ATTEMPTS)]
        if not any(s is not None and s != "aborted" for s in statuses):
            lost += 1
    return {"lost": lost, "tool_twice": int(tool_twice), "call_twice": int(call_twice),
            "tool_results": int(tools), "statuses": sorted(set(finished.values()))}


def _next_events(store: EventStore, inflight: dict[str, tuple[int, str]],
                 killed_at: float) -> dict[str, float]:
    with store.db.connection() as conn:
        after = {}
        for stream_id, (version, _) in inflight.items():
            row = conn.execute(
                "SELECT extract(epoch FROM recorded_at) FROM events WHERE stream_id = %s"
                " AND stream_version = %s", (stream_id, version + 1)).fetchone()
            if row is not None:
                after[stream_id] = float(row[0]) - killed_at
    return after


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--kill-window", type=float, default=3.0,
                        help="the kill comes uniformly within this many seconds after the "
                             "replacement is ready")
    parser.add_argument("--dead-after", type=float, default=5.0,
                        help="TRAJSTORE_ROLLOUT_DEAD_AFTER_S of the workers (default: the "
                             "setting's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="where the tiny model is built or found (a temporary folder)")
    args = parser.parse_args(argv)
    for name in ("kills", "groups", "group_size", "max_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 <= args.kill_window <= 600 or not 1.0 < args.dead_after <= 600:
        parser.error("--kill-window must be in [0, 600] and --dead-after in (1, 600]")
    rng = random.Random(args.seed)

    # The broker stops before its folder is removed (it would run on, with nowhere to save).
    with tempfile.TemporaryDirectory() as tmp, scratch_database() as url, \
            embedded.scoped_redis_url(Settings(data_dir=Path(tmp) / "broker")) as broker:
        tmp_dir = Path(tmp)
        models = (args.data_dir or tmp_dir) / "models"
        model = tiny_model_path(models)
        settings = Settings(database_url=url, redis_url=broker, data_dir=tmp_dir)
        store = EventStore(Database(url, max_size=2), settings)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
        env.update({"TRAJSTORE_DATABASE_URL": url, "TRAJSTORE_REDIS_URL": broker,
                    "TRAJSTORE_DATA_DIR": str(tmp_dir), "TRAJSTORE_VISIBILITY_TIMEOUT_S": "3600",
                    "TRAJSTORE_ROLLOUT_DEAD_AFTER_S": str(args.dead_after),
                    "TRAJSTORE_ROLLOUT_CONCURRENCY": str(args.groups * args.group_size),
                    "TRAJSTORE_ROLLOUT_GROUPS": str(args.groups),
                    "TORCH_NUM_THREADS": env.get("TORCH_NUM_THREADS", "1")})
        from workers.app import app, configure
        from workers.rollout.group import group_id_for

        configure(app, settings)
        run_id = f"bench-resume-{uuid.uuid4().hex[:6]}"
        store.append(run_stream_id(run_id), [RunCreated(run_id=run_id, config=RunConfig(
            group_size=args.group_size, tokenizer=str(model),
            rollout=RolloutConfig(seed=args.seed, max_tokens=args.max_tokens)))], NO_STREAM)
        workers: list[Worker] = []
        slots: list[tuple[str, int]] = []
        delays: list[float] = []
        inflight_total = 0
        regenerated = 0
        started = time.monotonic()
        try:
            active = Worker(env, tmp_dir / "worker-0.log")
            workers.append(active)
            active.wait_ready()
            for kill in range(args.kills):
                # The replacement is ready before the groups are sent (it may take some of
                # them: the active worker is killed with whatever it plays).
                spare = Worker(env, tmp_dir / f"worker-{kill + 1}.log")
                workers.append(spare)
                spare.wait_ready()
                for g in range(args.groups):
                    index = kill * args.groups + g
                    task = f"arith-{args.seed}-{index}"
                    app.send_task("trajstore.rollout_group", args=[run_id, task],
                                  kwargs={"group_index": index}, queue="rollout")
                    group_id = group_id_for(run_id, task, 0, index)
                    slots += [(group_id, s) for s in range(args.group_size)]
                while not _open_streams(store, run_id):
                    time.sleep(0.1)
                time.sleep(rng.uniform(0, args.kill_window))
                inflight = _open_streams(store, run_id)
                killed_at = time.time()
                active.kill()
                inflight_total += len(inflight)
                regenerated += sum(1 for _, waits in inflight.values() if waits == "llm")
                print(f"kill {kill + 1}: {len(inflight)} episodes in flight", flush=True)
                active = spare
                deadline = time.monotonic() + 600
                while _open_streams(store, run_id) or len(
                        _finished_slots(store, run_id)) < len(slots):
                    if time.monotonic() > deadline:
                        raise SystemExit("the groups did not finish within 600 s after a kill")
                    time.sleep(0.5)
                after = _next_events(store, inflight, killed_at)
                delays += list(after.values())
                if after:
                    print(f"  next event after the kill: median "
                          f"{statistics.median(after.values()):.2f} s, max "
                          f"{max(after.values()):.2f} s ({len(after)} episodes)", flush=True)
        finally:
            for worker in workers:
                worker.stop()
        counted = _counted(store, run_id, slots)
        store.close()
    regenerated += counted["call_twice"]
    report = {
        "episodes": len(slots), "kills": args.kills, "inflight": inflight_total,
        "episodes_lost": counted["lost"], "tool_duplicates": counted["tool_twice"],
        "tool_results": counted["tool_results"], "statuses": counted["statuses"],
        "regenerated_calls_per_inflight": regenerated / inflight_total if inflight_total
        else float("nan"),
        "median_kill_to_next_event_s": statistics.median(delays) if delays else float("nan"),
        "seconds": time.monotonic() - started,
    }
    print(f"{report['episodes']} episodes, {args.kills} kills, {inflight_total} episodes in "
          f"flight at a kill, {counted['tool_results']} tool results; statuses "
          f"{', '.join(counted['statuses'])}; {report['seconds']:.0f} s")
    print(f"RESULT episodes_lost={report['episodes_lost']} "
          f"tool_duplicates={report['tool_duplicates']} "
          f"regenerated_calls_per_inflight={report['regenerated_calls_per_inflight']:.2f} "
          f"median_kill_to_next_event_s={report['median_kill_to_next_event_s']:.2f}")
    return report


def _finished_slots(store: EventStore, run_id: str) -> set[str]:
    with store.db.connection() as conn:
        return {r[0] for r in conn.execute(
            "SELECT stream_id FROM events WHERE run_id = %s AND type = 'episode_finished'",
            (run_id,)).fetchall()}


if __name__ == "__main__":
    main()
