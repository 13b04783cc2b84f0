"""Isolation between projects on one ``trajstore serve`` process: the victim project's
ordinary requests, quiet and while attacker projects flood the shared resources, each
flood from client processes of its own (an attacker is another client: its work of building
and sending bodies does not share the interpreter that times the victim's requests; it still
shares the machine's cores). Every flood sends its next request as soon as the last is
answered.

The victim, one request at a time from this process: an episode appended (``ingest``), the
runs listed (``query``), the episode read back (``read``); with ``gateway`` among the
workloads, a call through the capture gateway's in-process tiny engine (``gateway``); with
``template`` or ``replay``, the time from its finished episode's append to the episode's
samples written by the shared replay worker (``replay``, a real ``trajstore worker --queues
replay`` with its default slots, ``REPLAY_PROJECT_RUNNING + 1``, unless ``--replay-slots``
says).

The attackers' floods (``--workloads``, each from a project of its own, one process each,
``--attackers`` in all):

- ``otlp``: gzip OTLP exports over ``OTLP_MAX_SPANS`` (413, or 429 past
  ``OTLP_MAX_CONCURRENT`` and the refusal budget);
- ``oversized``: ingest bodies over ``API_MAX_REQUEST_BYTES`` with their Content-Length;
- ``chunked``: the same bodies sent chunked, without a Content-Length;
- ``gateway``: gateway calls with 10,000 stop strings or 1,000 tools (422 by the caps);
- ``tokenizer``: runs naming tokenizer folders outside the roots, each spelled anew (422);
- ``template``: episodes of a run whose ``chat_template`` loops for ever, which the shared
  replay worker renders under ``RENDER_BUDGET_S`` and records invalid;
- ``replay``: a burst of ``--replay-burst`` ordinary finished episodes (two calculator calls,
  rewarded) at the start of each flood, one per request as fast as the API takes them, each a
  replay on the shared replay worker: faster than one replay slot projects them, so a backlog
  builds up, which the replay budget keeps to ``REPLAY_PROJECT_RUNNING`` replays queued or
  running (``--replay-places``).

Prints the victim's p99 per workload against quiet, its errors and the attacker's answers by
kind.

Two options change what is measured, and are printed with the figures when given:
``--attacker-nice N`` runs the attacking processes at that ``nice`` (lower CPU priority): on
a machine of few cores the attackers' own work of building and sending requests takes the
cores the server needs, which clients on other machines would not; ``--api-workers N``
serves with that many API processes (``TRAJSTORE_API_WORKERS``, one by default).

    python bench/isolation.py [--rounds 200 --workloads otlp,oversized,chunked,gateway,...]

Ends with ``RESULT victim_p99_ratio=<worst p99 flood/quiet> api_p99_ratio=<worst of the API
requests> [replay_p99_ratio=<replay>] victim_errors=<n> refusals_413=<n> refusals_429=<n>
refusals_422=<n> refusals_other=<n> accepted=<n> attacker_nice=<n> api_workers=<n>
load_avg=<1-minute load average at the end>`` (target ratio <= 2.0, errors 0;
``accepted``: the attackers' requests answered 2xx, the hostile template's and the replay
flood's episodes).
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from api.keys import KeyStore  # noqa: E402
from bench.api import batch_json  # noqa: E402
from bench.auth_flood import _Server  # noqa: E402
from bench.common import scratch_database  # noqa: E402
from store.db import Database  # noqa: E402
from store.settings import Settings  # noqa: E402

__all__ = ["WORKLOADS", "main", "measure"]

_MAX_BODY = 2 * 1024 * 1024
#: Every flood, in the order the attackers take them.
WORKLOADS = ("otlp", "oversized", "chunked", "gateway", "tokenizer", "template", "replay")
#: The floods that aim at the shared replay worker (started when one of them is run).
REPLAY_FLOODS = ("template", "replay")
#: A template that loops for ever in practice (10^10 steps), printing nothing.
_BUSY = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
_TOOL = {"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                          "parameters": {"type": "object", "properties": {}}}}


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]


def _otlp_flood(spans: int) -> bytes:
    def span(i: int) -> dict[str, Any]:
        return {"traceId": uuid.uuid4().hex, "spanId": uuid.uuid4().hex[:16],
                "name": "chat", "startTimeUnixNano": "1", "endTimeUnixNano": "2",
                "attributes": [{"key": f"gen_ai.k{k}", "value": {"stringValue": "v" * 20}}
                               for k in range(4)]}
    body = {"resourceSpans": [{"scopeSpans": [{"spans": [span(i) for i in range(spans)]}]}]}
    return gzip.compress(json.dumps(body).encode())


def _episode_body(tokenizer: Any, run_id: str, seed: int) -> bytes:
    """A finished episode (two calculator calls, a reward) as the ingest route takes it."""
    from bench.replay import episode

    events = batch_json(episode(tokenizer, run_id, f"g{seed}", 2, seed), encoding="base64",
                        prompt_refs=False)
    for event in events:
        event["event_id"] = str(uuid.uuid4())
    return json.dumps({"expected_version": "no_stream", "events": events}).encode()


def _chunks(size: int) -> Iterator[bytes]:
    piece = b"x" * 65536
    while size > 0:
        yield piece[:size]
        size -= len(piece)


def _attack(url: str, token: str, kind: str, extra: dict[str, Any], stop: Any,
            flooding: Any, ready: Any, counts: Any) -> None:
    """One attacking client process: floods ``kind`` while ``flooding`` is set, until
    ``stop`` is, one request at a time (the next as soon as the last is answered), then puts
    its answers by kind on ``counts``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if extra.get("attacker_nice"):
        os.nice(int(extra["attacker_nice"]))
    bad = {"Authorization": f"Bearer {token}"}
    out: dict[str, int] = {"413": 0, "429": 0, "422": 0, "other": 0, "accepted": 0}
    flood_otlp = _otlp_flood(20_000) if kind == "otlp" else b""
    oversized = b"x" * (_MAX_BODY + 1)
    stops = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                        "stop": [f"s{i}" for i in range(10_000)]}).encode()
    tools = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                        "tools": [_TOOL] * 1000}).encode()
    n = 0
    burst_left, was_flooding = 0, False
    with httpx.Client(base_url=url, timeout=120) as c:
        ready.put(kind)
        while not stop.is_set():
            if not flooding.wait(0.05):
                was_flooding = False
                continue
            if kind == "replay":
                # One burst per flood: a project that finishes many episodes at once.
                if not was_flooding:
                    burst_left, was_flooding = extra["replay_burst"], True
                if burst_left <= 0:
                    stop.wait(0.05)
                    continue
                burst_left -= 1
            n += 1
            json_headers = {**bad, "Content-Type": "application/json"}
            try:
                if kind == "otlp":
                    a = c.post("/v1/traces", content=flood_otlp,
                               headers={**json_headers, "Content-Encoding": "gzip"})
                elif kind == "oversized":
                    a = c.post(f"/v1/episodes/a-{uuid.uuid4().hex[:8]}/events",
                               content=oversized, headers=json_headers)
                elif kind == "chunked":
                    a = c.post(f"/v1/episodes/a-{uuid.uuid4().hex[:8]}/events",
                               content=_chunks(_MAX_BODY + 1), headers=json_headers)
                elif kind == "gateway":
                    a = c.post(f"/v1/runs/a-run-{n}/episodes/a-{uuid.uuid4().hex[:8]}"
                               "/chat/completions", content=stops if n % 2 else tools,
                               headers=json_headers)
                elif kind == "tokenizer":
                    # Folders outside the roots, each spelled anew (./, //, ..).
                    folder = ["/etc", "/usr/lib", "/proc/self"][n % 3] + "/." * (n % 7) + \
                        "//x/.." * (n % 5)
                    a = c.post("/v1/runs", headers=bad, json={
                        "run_id": f"a-tok-{uuid.uuid4().hex[:10]}",
                        "config": {"group_size": 1, "tokenizer": folder}})
                elif kind == "template":
                    body = json.loads(extra["template_bodies"][n % len(
                        extra["template_bodies"])])
                    for event in body["events"]:
                        event["event_id"] = str(uuid.uuid4())
                    a = c.post(f"/v1/episodes/a-{uuid.uuid4().hex[:10]}/events",
                               content=json.dumps(body).encode(), headers=json_headers)
                    # One episode a second: the replay worker's slots, not the API, are the
                    # resource this flood aims at.
                    stop.wait(1.0)
                elif kind == "replay":
                    body = json.loads(extra["flood_bodies"][n % len(extra["flood_bodies"])])
                    for event in body["events"]:
                        event["event_id"] = str(uuid.uuid4())
                    a = c.post(f"/v1/episodes/a-{uuid.uuid4().hex[:10]}/events",
                               content=json.dumps(body).encode(), headers=json_headers)
                else:
                    raise ValueError(f"unknown workload {kind!r}")
                status = a.status_code
            except httpx.HTTPError:
                status = 0
            if 200 <= status < 300:
                out["accepted"] += 1
            else:
                out[str(status) if str(status) in out else "other"] += 1
    counts.put(out)


def _wait_replayed(db: Database, episode: str, since: float, timeout: float = 600) -> float:
    """Seconds from ``since`` until ``episode``'s projection is written."""
    while time.monotonic() - since < timeout:
        with db.connection() as conn:
            row = conn.execute("SELECT projected_version FROM episodes WHERE episode_id = %s",
                               (episode,)).fetchone()
        if row is not None and row[0]:
            return time.monotonic() - since
        time.sleep(0.005)
    raise RuntimeError(f"{episode} was not replayed within {timeout} s")


class _Victim:
    """The victim's workloads, one request at a time."""

    def __init__(self, url: str, token: str, reader: str, *, gateway: bool,
                 replay_db: Database | None, tokenizer: Any) -> None:
        self.http = httpx.Client(base_url=url, timeout=120, headers={
            "Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        self.read = {"Authorization": f"Bearer {reader}"}
        self.gateway = gateway
        self.replay_db = replay_db
        self.tokenizer = tokenizer
        self.run_id = f"victim-{uuid.uuid4().hex[:8]}"
        r = self.http.post("/v1/runs", json={"run_id": self.run_id, "config": {
            "group_size": 1, "tokenizer": "qwen3"}})
        if r.status_code != 201:
            raise RuntimeError(f"run creation failed: {r.status_code} {r.text[:200]}")

    def names(self) -> list[str]:
        return ["ingest", "query", "read"] + (["gateway"] if self.gateway else []) + (
            ["replay"] if self.replay_db is not None else [])

    def round(self, seed: int, times: dict[str, list[float]]) -> int:
        """One round of every workload; returns its errors."""
        errors = 0
        episode = f"v-{uuid.uuid4().hex[:10]}"
        body = _episode_body(self.tokenizer, self.run_id, seed)
        calls = [
            ("ingest", lambda: self.http.post(f"/v1/episodes/{episode}/events", content=body)),
            ("query", lambda: self.http.get("/v1/runs", headers=self.read)),
            ("read", lambda: self.http.get(f"/v1/episodes/{episode}?tokens=false",
                                           headers=self.read))]
        if self.gateway:
            calls.append(("gateway", lambda: self.http.post(
                f"/v1/runs/{self.run_id}-gw/episodes/{episode}-gw/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                      "temperature": 0})))
        for name, call in calls:
            t0 = time.perf_counter()
            r = call()
            took = time.perf_counter() - t0
            times[name].append(took)
            if r.status_code >= 400:
                errors += 1
                print(f"victim {name}: {r.status_code} {r.text[:300]}", file=sys.stderr)
            if name == "ingest" and self.replay_db is not None:
                times["replay"].append(_wait_replayed(self.replay_db, episode,
                                                      time.monotonic()))
        return errors


def _start_replay_worker(url: str, tmp: Path, render_budget_s: float,
                         replay_places: int | None = None, slots: int | None = None,
                         over_share_nice: int | None = None) -> subprocess.Popen[bytes]:
    from store import embedded

    broker = embedded.redis_url(Settings(database_url=url, data_dir=tmp))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
    env.update(TRAJSTORE_DATABASE_URL=url, TRAJSTORE_REDIS_URL=broker,
               TRAJSTORE_DATA_DIR=str(tmp), TRAJSTORE_RENDER_BUDGET_S=str(render_budget_s))
    if replay_places is not None:
        env["TRAJSTORE_REPLAY_PROJECT_RUNNING"] = str(replay_places)
    if over_share_nice is not None:
        env["TRAJSTORE_REPLAY_OVER_SHARE_NICE"] = str(over_share_nice)
    log = tmp / "worker.log"
    with open(log, "ab") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "trajstore", "worker", "--queues", "replay",
             *(["--concurrency", str(slots)] if slots is not None else [])],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if b" ready." in log.read_bytes():
            return worker
        if worker.poll() is not None:
            raise RuntimeError(f"the replay worker exited: {log.read_text()[-2000:]}")
        time.sleep(0.1)
    raise RuntimeError("the replay worker did not start")


def _replayed_all(db: Database, timeout: float = 600) -> None:
    """Wait until every finished episode is replayed (the hostile template's backlog)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with db.connection() as conn:
            (left,) = conn.execute(
                "SELECT count(*) FROM events f WHERE f.type = 'episode_finished' AND NOT EXISTS"
                " (SELECT 1 FROM episodes p WHERE p.episode_id = f.stream_id"
                "  AND p.projected_version >= f.stream_version)").fetchone()
        if not left:
            return
        time.sleep(0.05)
    raise RuntimeError(f"the replay backlog did not drain within {timeout} s")


def measure(url: str, victim: _Victim, attackers_keys: dict[str, str], *, rounds: int,
            workloads: list[str], attackers: int, extra: dict[str, Any], block: int = 10
            ) -> dict[str, Any]:
    """The victim's p99s quiet and under the floods, its errors, the attacker's answers.
    Quiet and flood alternate in blocks of ``block`` rounds (the attackers wait between
    floods), so that what else the machine runs weighs on both alike; a quiet block starts
    once the replay worker has replayed every episode the floods left (no backlog of theirs
    is timed as quiet)."""
    names = victim.names()
    quiet: dict[str, list[float]] = {n: [] for n in names}
    flood: dict[str, list[float]] = {n: [] for n in names}
    victim.round(0, {n: [] for n in names})  # warm-up: first loads, first connections
    ctx = multiprocessing.get_context("spawn")
    stop, flooding, ready, counts = ctx.Event(), ctx.Event(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_attack, daemon=True, args=(
        url, attackers_keys[workloads[k % len(workloads)]], workloads[k % len(workloads)],
        extra, stop, flooding, ready, counts)) for k in range(attackers)]
    for p in procs:
        p.start()
    for _ in procs:  # every attacker's interpreter is up, its bodies built
        ready.get(timeout=300)
    errors = 0
    answers: dict[str, int] = {}
    try:
        # A first flood: the attackers' first requests, the server's first refusals, and the
        # victim's first rounds beside them, untimed: a replay slot that a flood leaves to
        # the victim loads the victim's tokenizer on its first replay (about a second on a
        # process that never replayed the run), a cost of the slot's first use that the
        # quiet rounds, which find the warm-up's slot, never pay.
        flooding.set()
        warm_until = time.monotonic() + 3.0
        seed = 10 * rounds + 10
        while time.monotonic() < warm_until:
            victim.round(seed, {n: [] for n in names})
            seed += 1
        flooding.clear()
        time.sleep(1.0)
        if victim.replay_db is not None:
            _replayed_all(victim.replay_db)
        done = 0
        while done < rounds:
            n = min(block, rounds - done)
            for phase, times in ((quiet, False), (flood, True)):
                if times:
                    flooding.set()
                    time.sleep(0.3)  # the floods are under way
                errors += sum(victim.round(1 + 2 * done + i + (rounds if times else 0), phase)
                              for i in range(n))
                if times:
                    flooding.clear()
                    time.sleep(0.3)  # requests in flight are answered
                    if victim.replay_db is not None:
                        _replayed_all(victim.replay_db)
            done += n
    finally:
        stop.set()
        flooding.set()
        for _ in procs:
            for kind, n in counts.get(timeout=300).items():
                answers[kind] = answers.get(kind, 0) + n
        for p in procs:
            p.join(timeout=60)
    ratios = {n: _p99(flood[n]) / _p99(quiet[n]) for n in names}
    return {"quiet": {n: _p99(v) for n, v in quiet.items()},
            "flood": {n: _p99(v) for n, v in flood.items()},
            "median": {n: (statistics.median(quiet[n]), statistics.median(flood[n]))
                       for n in names},
            "times": {"quiet": quiet, "flood": flood},
            "ratios": ratios, "errors": errors, "answers": answers}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"Floods, comma separated, of {', '.join(WORKLOADS)}.")
    parser.add_argument("--attackers", type=int, default=0,
                        help="Attacking processes (default: one per flood).")
    parser.add_argument("--render-budget-s", type=float, default=0.5,
                        help="RENDER_BUDGET_S of the replay worker.")
    parser.add_argument("--attacker-nice", type=int, default=0,
                        help="nice of the attacking processes (0: as this process; 19 stands "
                        "for clients on other machines, which take no core of the server's).")
    parser.add_argument("--api-workers", type=int, default=1,
                        help="API server processes (TRAJSTORE_API_WORKERS).")
    parser.add_argument("--keep-logs", default=None,
                        help="Copy the server's and the replay worker's logs to this folder.")
    parser.add_argument("--times-json", default=None,
                        help="Write every timing (seconds, by phase and workload) here.")
    parser.add_argument("--replay-burst", type=int, default=200,
                        help="Episodes the replay flood finishes at the start of each flood.")
    parser.add_argument("--replay-slots", type=int, default=None,
                        help="Processes of the replay worker (its --concurrency; default: "
                        "the worker's default, REPLAY_PROJECT_RUNNING + 1).")
    parser.add_argument("--replay-places", type=int, default=None,
                        help="REPLAY_PROJECT_RUNNING of the replay worker (default: the "
                        "setting's default).")
    parser.add_argument("--api-share-max-delay-s", type=float, default=None,
                        help="API_SHARE_MAX_DELAY_S of the server (default: the setting's "
                        "default; 0: a project over its share of the API's time never "
                        "waits).")
    parser.add_argument("--over-share-nice", type=int, default=None,
                        help="REPLAY_OVER_SHARE_NICE of the replay worker (default: the "
                        "setting's default; 0: a project over its share of the replay CPU "
                        "replays at the worker's priority).")
    args = parser.parse_args(argv)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown or not workloads:
        parser.error(f"--workloads: unknown {unknown}; give some of {', '.join(WORKLOADS)}")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if args.replay_burst < 1 or (args.replay_slots is not None and args.replay_slots < 1):
        parser.error("--replay-burst and --replay-slots must be >= 1")
    attackers = args.attackers or len(workloads)
    started_load = os.getloadavg()[0]
    from workers.engines.tokenizers import load_tokenizer

    tokenizer = load_tokenizer("qwen3")
    with scratch_database() as url, tempfile.TemporaryDirectory() as tmp:
        settings = Settings(database_url=url)
        with Database(url) as db:
            keys = KeyStore(db, settings)
            victim_key = keys.create(project="victim", role="ingest").token
            reader = keys.create(project="victim", role="read").token
            # Each flood from a project of its own: the refusal budget of one does not stop
            # the others (the hostile template's episodes are accepted, not refused).
            attacking = {w: keys.create(project=f"attacker-{w}", role="ingest").token
                         for w in workloads}
            keys.close()
        gateway = "gateway" in workloads
        env = {"TRAJSTORE_API_MAX_REQUEST_BYTES": str(_MAX_BODY),
               "TRAJSTORE_OTLP_MAX_SPANS": "200", "TRAJSTORE_DATA_DIR": tmp}
        if args.api_share_max_delay_s is not None:
            env["TRAJSTORE_API_SHARE_MAX_DELAY_S"] = str(args.api_share_max_delay_s)
        if gateway:
            env.update(TRAJSTORE_GATEWAY_ENGINE_MODEL="tiny", TRAJSTORE_GATEWAY_MAX_TOKENS="8")
        # Replay is left to replay workers, as deployments do (``trajstore up``).
        server = _Server(url, workers=args.api_workers, log=Path(tmp) / "serve.log", env=env,
                         args=("--no-replay",))
        worker = None
        replay_db = None
        extra: dict[str, Any] = {"replay_burst": args.replay_burst,
                                 "attacker_nice": args.attacker_nice}
        try:
            if any(w in REPLAY_FLOODS for w in workloads):
                worker = _start_replay_worker(url, Path(tmp), args.render_budget_s,
                                              args.replay_places, args.replay_slots,
                                              args.over_share_nice)
                replay_db = Database(url, max_size=1)
            if "replay" in workloads:
                flood_run = f"a-flood-{uuid.uuid4().hex[:8]}"
                r = httpx.post(f"{server.url}/v1/runs", headers={
                    "Authorization": f"Bearer {attacking['replay']}"}, json={
                    "run_id": flood_run, "config": {"group_size": 1, "tokenizer": "qwen3"}},
                    timeout=60)
                if r.status_code != 201:
                    raise RuntimeError(f"flood run: {r.status_code} {r.text[:300]}")
                extra["flood_bodies"] = [_episode_body(tokenizer, flood_run, 20_000 + i)
                                         for i in range(8)]
            if "template" in workloads:
                hostile = f"a-hostile-{uuid.uuid4().hex[:8]}"
                r = httpx.post(f"{server.url}/v1/runs", headers={
                    "Authorization": f"Bearer {attacking['template']}"}, json={
                    "run_id": hostile, "config": {"group_size": 1, "tokenizer": "qwen3",
                                                  "chat_template": _BUSY +
                                                  tokenizer.chat_template}}, timeout=60)
                if r.status_code != 201:
                    raise RuntimeError(f"hostile run: {r.status_code} {r.text[:300]}")
                extra["template_bodies"] = [_episode_body(tokenizer, hostile, 10_000 + i)
                                            for i in range(4)]
            victim = _Victim(server.url, victim_key, reader, gateway=gateway,
                             replay_db=replay_db, tokenizer=tokenizer)
            result = measure(server.url, victim, attacking, rounds=args.rounds,
                             workloads=workloads, attackers=attackers, extra=extra)
            victim.http.close()
        finally:
            server.stop()
            if replay_db is not None:
                replay_db.close()
            if worker is not None:
                os.killpg(worker.pid, signal.SIGTERM)
                worker.wait(timeout=60)
            if args.keep_logs:
                import shutil

                Path(args.keep_logs).mkdir(parents=True, exist_ok=True)
                for log in Path(tmp).glob("*.log"):
                    shutil.copy(log, Path(args.keep_logs) / log.name)
            # The replay worker's broker stops before its folder is removed (it would run
            # on, with nowhere to save, until this process exits).
            from store import embedded

            embedded.stop_embedded_redis(Settings(data_dir=Path(tmp)))
    if any(w in REPLAY_FLOODS for w in workloads):
        from workers.fair import default_replay_slots

        places = args.replay_places or Settings().replay_project_running
        slots = args.replay_slots or default_replay_slots(
            Settings(replay_project_running=places))
        nice = args.over_share_nice if args.over_share_nice is not None else \
            Settings().replay_over_share_nice
        print(f"replay worker: {slots} slots, {places} places per project, projects over "
              f"their share of the replay CPU at nice {nice}")
    if args.attacker_nice or args.api_workers != 1:
        print(f"attackers at nice {args.attacker_nice}; {args.api_workers} API processes")
    print(f"floods: {', '.join(workloads)} ({attackers} attacking processes), "
          f"{args.rounds} rounds quiet and {args.rounds} under the floods; load average "
          f"{started_load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")
    for name in result["quiet"]:
        q, f = result["median"][name]
        print(f"{name:8s} p99 quiet {result['quiet'][name] * 1000:8.1f} ms  flood "
              f"{result['flood'][name] * 1000:8.1f} ms  ratio {result['ratios'][name]:.2f}"
              f"  (median {q * 1000:.1f} / {f * 1000:.1f} ms)")
    if args.times_json:
        Path(args.times_json).write_text(json.dumps(result["times"]))
    a = result["answers"]
    print(f"victim errors {result['errors']}; attacker answers {a}")
    worst = max(result["ratios"].values())
    api = max(v for k, v in result["ratios"].items() if k != "replay")
    replay = f" replay_p99_ratio={result['ratios']['replay']:.2f}" \
        if "replay" in result["ratios"] else ""
    print(f"RESULT victim_p99_ratio={worst:.2f} api_p99_ratio={api:.2f}{replay} "
          f"victim_errors={result['errors']} "
          f"refusals_413={a.get('413', 0)} refusals_429={a.get('429', 0)} "
          f"refusals_422={a.get('422', 0)} refusals_other={a.get('other', 0)} "
          f"accepted={a.get('accepted', 0)} attacker_nice={args.attacker_nice} "
          f"api_workers={args.api_workers} load_avg={os.getloadavg()[0]:.2f}")
    return result


if __name__ == "__main__":
    main()
