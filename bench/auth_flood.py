"""Wrong-secret flood: median latency of legitimate requests while a client floods the API with
wrong secrets, against the same requests without a flood, measured in one run against real
``trajstore serve`` processes, with the failure cache and budget on and off.

Keys use the default scrypt cost. The legitimate client sends ``GET /v1/keys/me`` with the
right key, one request at a time, 20 ms apart, for ``--seconds``. The flood is one process
sending ``--rate`` wrong secrets per second of the same key id (the public part of a key,
which an attacker can read from a log), open loop: on schedule whatever the answers take, as
an attacker would; every other request repeats one secret, the rest never repeat. Each arm
starts a server of its own (``TRAJSTORE_API_KEY_FAILURE_CACHE_S`` and
``TRAJSTORE_API_KEY_FAILURE_BUDGET`` at their defaults, or both 0 for "off") and measures the
quiet baseline first, then the flood.

    python bench/auth_flood.py [--seconds 10 --rate 40 --workers 1]

Ends with ``RESULT flood_vs_quiet_off=<x> flood_vs_quiet_on=<y> quiet_ms=<q> flood_on_ms=<f>
p99_flood_off_ms=<a> p99_flood_on_ms=<b>``: how many times slower the median legitimate
request is during the flood, without and with the protection, and the 99th percentiles.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from api.keys import KeyStore  # noqa: E402
from bench.api import _free_port  # noqa: E402
from bench.common import scratch_database  # noqa: E402
from store.db import Database  # noqa: E402
from store.settings import Settings  # noqa: E402

__all__ = ["main", "measure"]

ME = "/v1/keys/me"


class _Server:
    """``trajstore serve`` on a free port with the given extra settings."""

    def __init__(self, url: str, *, workers: int, log: Path, env: dict[str, str],
                 args: tuple[str, ...] = ()) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        full = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
        full.update(TRAJSTORE_DATABASE_URL=url, TRAJSTORE_LOG_LEVEL="WARNING", **env)
        self._log = open(log, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trajstore", "serve", "--host", "127.0.0.1", "--port",
             str(self.port), "--workers", str(workers), *args],
            env=full, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
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
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # still hashing the flood's backlog
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._log.close()


def _wrong(token: str, n: int) -> str:
    """``token`` with another secret of the same length: the same key id."""
    return token[:21] + f"{n:08d}" + token[29:]


def _legit(client: httpx.Client, token: str, seconds: float, pause_s: float) -> list[float]:
    """Seconds of each legitimate request sent for ``seconds``, one at a time, ``pause_s``
    apart (samples spread over the whole phase)."""
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        r = client.get(ME, headers={"Authorization": f"Bearer {token}"})
        out.append(time.perf_counter() - t0)
        if r.status_code != 200:
            raise RuntimeError(f"the right key got {r.status_code}: {r.text[:200]}")
        time.sleep(pause_s)
    return out


def _flood(url: str, token: str, rate: float, stop: Any, counts: Any) -> None:
    """The flooding client, a process of its own (it does not share the measuring client's
    interpreter): ``rate`` wrong secrets of the token's key id per second, open loop (sent on
    schedule whatever the answers take, at most 256 in flight), until ``stop``. Every other
    request repeats one secret; the rest never repeat."""
    import asyncio

    async def run() -> None:
        slot = {401: 0, 429: 1}
        in_flight = asyncio.Semaphore(256)
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

            async def send(secret: str) -> None:
                try:
                    r = await client.get(ME, headers={"Authorization": f"Bearer {secret}"})
                    index = slot.get(r.status_code, 2)
                except httpx.HTTPError:
                    index = 3
                finally:
                    in_flight.release()
                with counts.get_lock():
                    counts[index] += 1

            tasks = set()
            start, n = time.monotonic(), 0
            while not stop.is_set():
                n += 1
                delay = start + n / rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                if in_flight.locked():  # the server is that far behind: count it as skipped
                    with counts.get_lock():
                        counts[4] += 1
                    continue
                await in_flight.acquire()
                task = asyncio.create_task(send(_wrong(token, 1 if n % 2 else n)))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            for task in list(tasks):
                task.cancel()

    asyncio.run(run())


def measure(url: str, token: str, *, seconds: float, rate: float, workers: int, log: Path,
            protection: bool, pause_s: float = 0.02) -> dict[str, Any]:
    """Median legitimate latency without and with a flood, on a server of its own."""
    env = {} if protection else {"TRAJSTORE_API_KEY_FAILURE_CACHE_S": "0",
                                 "TRAJSTORE_API_KEY_FAILURE_BUDGET": "0"}
    server = _Server(url, workers=workers, log=log, env=env)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            _legit(client, token, 1.0, 0.0)  # warm up: the key is checked once and trusted
            quiet = _legit(client, token, seconds, pause_s)
            stop = multiprocessing.Event()
            counts = multiprocessing.Array("i", 5)  # 401, 429, other, failed, not sent
            flooder = multiprocessing.Process(target=_flood, daemon=True,
                                              args=(server.url, token, rate, stop, counts))
            flooder.start()
            time.sleep(2.0)  # the flood is under way before the legitimate client starts
            try:
                flooded = _legit(client, token, seconds, pause_s)
            finally:
                stop.set()
                flooder.join(timeout=60)
                if flooder.is_alive():
                    flooder.kill()
            answers = dict(zip(("401", "429", "other", "failed", "not_sent"), counts[:],
                               strict=True))
    finally:
        server.stop()
    q, f = statistics.median(quiet), statistics.median(flooded)
    return {"quiet_s": q, "flood_s": f, "ratio": f / q, "flood_answers": answers,
            "quiet_p99_s": _p99(quiet), "flood_p99_s": _p99(flooded),
            "quiet_requests": len(quiet), "flood_requests": len(flooded)}


def _p99(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, int(0.99 * len(values)))]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0,
                        help="length of each phase (legitimate requests 20 ms apart)")
    parser.add_argument("--rate", type=float, default=40.0,
                        help="wrong secrets per second the flood sends")
    parser.add_argument("--workers", type=int, default=1, help="API server processes")
    args = parser.parse_args(argv)
    if not 0 < args.seconds <= 3600 or args.workers < 1 or not 0 < args.rate <= 100_000:
        parser.error("--seconds must be in (0, 3600], --workers >= 1, --rate in (0, 100000]")
    results: dict[str, Any] = {}
    with scratch_database() as url, tempfile.TemporaryDirectory() as tmp:
        settings = Settings(database_url=url)  # the default scrypt cost, as deployed
        db = Database(url, max_size=2)
        keys = KeyStore(db, settings)
        token = keys.create(project="bench", role="read").token
        keys.close()
        db.close()
        for arm, protection in (("off", False), ("on", True)):
            results[arm] = measure(url, token, seconds=args.seconds, rate=args.rate,
                                   workers=args.workers, log=Path(tmp) / f"serve-{arm}.log",
                                   protection=protection)
            r = results[arm]
            print(f"protection {arm:>3}: median legitimate request {1000 * r['quiet_s']:.2f} ms "
                  f"quiet, {1000 * r['flood_s']:.2f} ms during the flood "
                  f"({r['ratio']:.1f}x); p99 {1000 * r['quiet_p99_s']:.1f} ms quiet, "
                  f"{1000 * r['flood_p99_s']:.1f} ms flood; {r['quiet_requests']} and "
                  f"{r['flood_requests']} requests; flood answers {r['flood_answers']}")
    off, on = results["off"], results["on"]
    print(f"RESULT flood_vs_quiet_off={off['ratio']:.2f} flood_vs_quiet_on={on['ratio']:.2f} "
          f"quiet_ms={1000 * on['quiet_s']:.2f} flood_on_ms={1000 * on['flood_s']:.2f} "
          f"p99_flood_off_ms={1000 * off['flood_p99_s']:.1f} "
          f"p99_flood_on_ms={1000 * on['flood_p99_s']:.1f}")
    return results


if __name__ == "__main__":
    main()
