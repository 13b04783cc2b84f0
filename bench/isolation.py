"""Isolation between projects on one ``trajstore serve`` process: the victim project's
ordinary requests (an episode appended, the runs listed, the episode read back), quiet and
while an attacker project floods the OTLP route with exports over ``OTLP_MAX_SPANS`` (from
several threads, so past ``OTLP_MAX_CONCURRENT`` too) and the ingest route with bodies over
``API_MAX_REQUEST_BYTES``. Prints the victim's p99 per workload against quiet, its errors and
the attacker's refusals by kind.

Not covered here yet: rollouts (measured by ``tests/api/test_rollout_budget.py`` with real
workers), gateway calls, template rendering and tokenizer folders.

    python bench/isolation.py [--rounds 30 --attackers 3]

Ends with ``RESULT victim_p99_ratio=<worst p99 flood/quiet> victim_errors=<n>
refusals_413=<n> refusals_429=<n> refusals_other=<n>`` (target ratio <= 2.0, errors 0).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from api.keys import KeyStore  # noqa: E402
from bench.api import batch_json, episode_events  # noqa: E402
from bench.auth_flood import _Server  # noqa: E402
from bench.common import scratch_database  # noqa: E402
from store.db import Database  # noqa: E402
from store.settings import Settings  # noqa: E402

__all__ = ["main"]

_MAX_BODY = 2 * 1024 * 1024


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


def _victim_round(http: httpx.Client, run_id: str, seed: int,
                  times: dict[str, list[float]], read: dict[str, str]) -> int:
    """One round of the victim's workloads; returns its errors."""
    errors = 0
    episode = f"v-{uuid.uuid4().hex[:10]}"
    body = json.dumps({"expected_version": "no_stream", "events": batch_json(
        episode_events(run_id=run_id, group_id=episode, n_events=7, prompt=64, response=32,
                       seed=seed), encoding="base64", prompt_refs=False)}).encode()
    for name, call in (
            ("ingest", lambda: http.post(f"/v1/episodes/{episode}/events", content=body)),
            ("query", lambda: http.get("/v1/runs", headers=read)),
            ("read", lambda: http.get(f"/v1/episodes/{episode}?tokens=false",
                                      headers=read))):
        t0 = time.perf_counter()
        r = call()
        times[name].append(time.perf_counter() - t0)
        if r.status_code >= 400:
            errors += 1
            if errors == 1 and seed == 0:
                print(f"victim {name}: {r.status_code} {r.text[:300]}", file=sys.stderr)
    return errors


def measure(url: str, victim: str, reader: str, attacker: str, *, rounds: int,
            attackers: int) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {victim}", "Content-Type": "application/json"}
    read = {"Authorization": f"Bearer {reader}"}
    bad = {"Authorization": f"Bearer {attacker}"}
    with httpx.Client(base_url=url, headers=headers, timeout=120) as http:
        run_id = f"victim-{uuid.uuid4().hex[:8]}"
        r = http.post("/v1/runs", json={"run_id": run_id, "config": {"group_size": 1}})
        if r.status_code != 201:
            raise RuntimeError(f"run creation failed: {r.status_code} {r.text[:200]}")
        quiet: dict[str, list[float]] = {"ingest": [], "query": [], "read": []}
        errors = sum(_victim_round(http, run_id, i, quiet, read) for i in range(rounds))
        flood_otlp = _otlp_flood(20_000)
        oversized = b"x" * (_MAX_BODY + 1)
        refusals: dict[str, int] = {"413": 0, "429": 0, "other": 0}
        lock = threading.Lock()
        stop = threading.Event()

        def attack(k: int) -> None:
            with httpx.Client(base_url=url, timeout=120) as c:
                while not stop.is_set():
                    if k % 2 == 0:
                        a = c.post("/v1/traces", content=flood_otlp, headers={
                            **bad, "Content-Type": "application/json",
                            "Content-Encoding": "gzip"})
                    else:
                        a = c.post(f"/v1/episodes/a-{uuid.uuid4().hex[:8]}/events",
                                   content=oversized,
                                   headers={**bad, "Content-Type": "application/json"})
                    kind = str(a.status_code) if a.status_code in (413, 429) else "other"
                    with lock:
                        refusals[kind] += 1

        threads = [threading.Thread(target=attack, args=(k,), daemon=True)
                   for k in range(attackers)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        flood: dict[str, list[float]] = {"ingest": [], "query": [], "read": []}
        try:
            errors += sum(_victim_round(http, run_id, rounds + i, flood, read)
                          for i in range(rounds))
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=120)
    ratios = {name: _p99(flood[name]) / _p99(quiet[name]) for name in quiet}
    return {"quiet": {n: _p99(v) for n, v in quiet.items()},
            "flood": {n: _p99(v) for n, v in flood.items()},
            "ratios": ratios, "errors": errors, "refusals": refusals}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--attackers", type=int, default=3)
    args = parser.parse_args(argv)
    with scratch_database() as url, tempfile.TemporaryDirectory() as tmp:
        settings = Settings(database_url=url)
        with Database(url) as db:
            keys = KeyStore(db, settings)
            victim = keys.create(project="victim", role="ingest").token
            reader = keys.create(project="victim", role="read").token
            attacker = keys.create(project="attacker", role="ingest").token
            keys.close()
        server = _Server(url, workers=1, log=Path(tmp) / "serve.log", env={
            "TRAJSTORE_API_MAX_REQUEST_BYTES": str(_MAX_BODY),
            "TRAJSTORE_OTLP_MAX_SPANS": "200"})
        try:
            result = measure(server.url, victim, reader, attacker, rounds=args.rounds,
                             attackers=args.attackers)
        finally:
            server.stop()
    for name in result["quiet"]:
        print(f"{name:8s} p99 quiet {result['quiet'][name] * 1000:8.1f} ms  flood "
              f"{result['flood'][name] * 1000:8.1f} ms  ratio {result['ratios'][name]:.2f}")
    print(f"victim errors {result['errors']}; attacker refusals {result['refusals']}")
    worst = max(result["ratios"].values())
    r = result["refusals"]
    print(f"RESULT victim_p99_ratio={worst:.2f} victim_errors={result['errors']} "
          f"refusals_413={r['413']} refusals_429={r['429']} refusals_other={r['other']}")
    return result


if __name__ == "__main__":
    main()
