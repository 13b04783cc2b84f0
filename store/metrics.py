"""Metrics in the Prometheus text format.

Most figures are read from the database when scraped, so that every process (API, workers,
trainer) reports the same truth whichever one is scraped: events by type, replay lag (finished
episodes not yet projected, in episodes and seconds), samples by status, lease expiries,
the trainer's last step time and tokens/s. The append latency is measured in the process that
appends (``observe_append``): a histogram per process.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the event log imports this module to time its appends
    from store.eventlog import EventStore

__all__ = ["AppendLatency", "APPEND_LATENCY", "observe_append", "render"]

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class AppendLatency:
    """A cumulative histogram of append durations (seconds), thread-safe."""

    def __init__(self, buckets: Iterable[float] = _BUCKETS) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.total = 0
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        with self._lock:
            self.total += 1
            self.sum += seconds
            for i, bound in enumerate(self.buckets):
                if seconds <= bound:
                    self.counts[i] += 1

    def lines(self, name: str) -> list[str]:
        with self._lock:
            out = [f'{name}_bucket{{le="{b:g}"}} {c}' for b, c in zip(self.buckets,
                                                                    self.counts, strict=True)]
            out += [f'{name}_bucket{{le="+Inf"}} {self.total}', f"{name}_sum {self.sum:.6f}",
                    f"{name}_count {self.total}"]
        return out


APPEND_LATENCY = AppendLatency()


def observe_append(seconds: float) -> None:
    """Record one append's duration in this process's histogram."""
    APPEND_LATENCY.observe(seconds)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(store: EventStore) -> str:
    """Every metric, in the Prometheus text exposition format (version 0.0.4)."""
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lines.append(f"{name}{labels} {value:g}")

    from store.rows import safe_data

    data = safe_data("data")  # a row stored with a NUL escape must not break the page
    with store.db.connection() as conn:
        by_type = conn.execute("SELECT type, count(*) FROM events GROUP BY type").fetchall()
        lag = conn.execute(
            """
            SELECT count(*), coalesce(extract(epoch FROM now() - min(f.recorded_at)), 0)
            FROM events f LEFT JOIN episodes p ON p.episode_id = f.stream_id
            WHERE f.type = 'episode_finished'
              AND (p.episode_id IS NULL OR p.projected_version < f.stream_version)
            """).fetchone()
        samples = conn.execute("SELECT status, count(*) FROM samples GROUP BY status").fetchall()
        expiries = conn.execute("SELECT count(*) FROM leases WHERE ended = 'expired'").fetchone()
        step = conn.execute(
            f"""
            SELECT ({data}->'metrics'->>'step_seconds')::float8,
                   ({data}->'metrics'->>'trainable_tokens')::float8
            FROM events WHERE type = 'policy_updated' ORDER BY position DESC LIMIT 1
            """).fetchone()
    metric("trajstore_events_total", "counter", "Events stored, by type.",
           [(f'{{type="{_label(t)}"}}', n) for t, n in by_type])
    metric("trajstore_replay_lag_episodes", "gauge",
           "Finished episodes not projected yet.", [("", lag[0] if lag else 0)])
    metric("trajstore_replay_lag_seconds", "gauge",
           "Age of the oldest finished episode not projected yet.",
           [("", float(lag[1]) if lag else 0.0)])
    statuses = dict.fromkeys(("ready", "leased", "consumed", "stale", "skipped"), 0)
    statuses.update({s: n for s, n in samples})
    metric("trajstore_samples", "gauge", "Samples by status.",
           [(f'{{status="{s}"}}', n) for s, n in statuses.items()])
    metric("trajstore_lease_expiries_total", "counter",
           "Leases that expired before their trainer acknowledged them.",
           [("", expiries[0] if expiries else 0)])
    seconds, tokens = (step or (None, None))
    metric("trajstore_trainer_step_seconds", "gauge", "Duration of the newest training step.",
           [("", seconds or 0.0)])
    metric("trajstore_trainer_tokens_per_second", "gauge",
           "Trainable tokens per second of the newest training step.",
           [("", (tokens / seconds) if seconds and tokens else 0.0)])
    lines.append("# HELP trajstore_append_seconds Append latency in this process.")
    lines.append("# TYPE trajstore_append_seconds histogram")
    lines += APPEND_LATENCY.lines("trajstore_append_seconds")
    return "\n".join(lines) + "\n"
