"""``trajstore status`` shows which policy version each run's rollout engines serve, and with
``--run`` every version's take-up; an unknown run is an error naming it (real subprocesses)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

from store import serving
from store.eventlog import NO_STREAM, EventStore, run_stream_id
from store.events import PolicyUpdated, RunCreated
from store.settings import Settings


def _status(settings: Settings, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
    env.update(TRAJSTORE_DATABASE_URL=settings.database_url or "",
               TRAJSTORE_DATA_DIR=str(settings.data_dir), COLUMNS="250")
    return subprocess.run([sys.executable, "-m", "trajstore", "status", *args], env=env,
                          capture_output=True, text=True, timeout=180)


def test_status_shows_the_engines_of_each_version(store: EventStore,
                                                  settings: Settings) -> None:
    run_id = f"cli-{uuid.uuid4().hex[:8]}"
    store.append(run_stream_id(run_id), [RunCreated(run_id=run_id)], NO_STREAM)
    for engine in ("node-a:11/AsyncVLLMBackend", "node-b:12/AsyncVLLMBackend"):
        serving.record_policy_served(store, run_id, version=0, engine=engine,
                                     backend="AsyncVLLMBackend")
    serving.append_policy_updated(store, run_id, PolicyUpdated(version=1, step=4))
    serving.record_policy_served(store, run_id, version=1, engine="node-a:11/AsyncVLLMBackend",
                                 backend="AsyncVLLMBackend", load_seconds=1.25)

    shown = _status(settings, "--run", run_id)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    summary = [line for line in lines if run_id in line and "│" in line]
    # The summary row: version 1, one engine serves it, one is behind.
    assert any(line.split("│")[1:5] and [c.strip() for c in line.split("│")[1:5]]
               == [run_id, "1", "1", "1"] for line in summary), shown.stdout
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in lines
            if "node-" in line]
    assert [(r[0], r[3]) for r in rows] == [("0", "node-a:11/AsyncVLLMBackend"),
                                           ("0", "node-b:12/AsyncVLLMBackend"),
                                           ("1", "node-a:11/AsyncVLLMBackend")]
    assert rows[2][1] == "4" and rows[2][7] == "1.25" and float(rows[2][6]) >= 0

    missing = _status(settings, "--run", "no-such-run")
    assert missing.returncode == 1 and "no run 'no-such-run'" in missing.stdout
