"""Metrics in the Prometheus text format, through ``prometheus_client``.

Most figures are read from the database when scraped (a custom collector, :class:`StoreCollector`),
so that every process (API, workers, trainer) reports the same truth whichever one is
scraped: events by type, episodes by status, replay lag (finished episodes not yet projected,
in episodes and seconds), how far each follower of the log is behind, samples by status, live
leases and the age of the oldest, lease expiries, the trainer's last step time and tokens/s.
The append latency is measured in the process that appends (``store.recorder.APPEND_LATENCY``):
a histogram per process, added to the registry here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from store.recorder import APPEND_LATENCY

if TYPE_CHECKING:
    from store.eventlog import EventStore

__all__ = ["APPEND_LATENCY", "CONTENT_TYPE", "StoreCollector", "registry", "render"]

#: The media type of :func:`render`'s text (the exposition format version 0.0.4).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

SAMPLE_STATUSES = ("ready", "leased", "consumed", "stale", "skipped", "no_reward")
EPISODE_STATUSES = ("running", "completed", "terminated", "truncated", "error", "aborted",
                    "invalid")


def _figures(store: EventStore) -> dict[str, Any]:
    """Everything the collector reports, read on one connection."""
    from store.rows import safe_data

    data = safe_data("data")  # a row stored with a NUL escape must not break the page
    with store.db.connection() as conn:
        def one(sql: str) -> Any:
            return conn.execute(sql).fetchone()

        return {
            "by_type": conn.execute("SELECT type, count(*) FROM events GROUP BY type")
            .fetchall(),
            "lag": one("""
                SELECT count(*), coalesce(extract(epoch FROM now() - min(f.recorded_at)), 0)
                FROM events f LEFT JOIN episodes p ON p.episode_id = f.stream_id
                WHERE f.type = 'episode_finished'
                  AND (p.episode_id IS NULL OR p.projected_version < f.stream_version)"""),
            "episodes": conn.execute(
                "SELECT status, count(*) FROM episodes GROUP BY status").fetchall(),
            "running": one("""
                SELECT count(*) FROM events s
                WHERE s.type = 'episode_started'
                  AND NOT EXISTS (SELECT 1 FROM events f WHERE f.stream_id = s.stream_id
                                                            AND f.type = 'episode_finished')
                """),
            "followers": conn.execute("""
                SELECT l.name, count(e.position),
                       coalesce(extract(epoch FROM now() - min(e.recorded_at)), 0)
                FROM log_followers l
                LEFT JOIN events e ON (e.tx_id, e.position) > (l.tx_id::text::xid8, l.position)
                GROUP BY l.name ORDER BY l.name""").fetchall(),
            "samples": conn.execute(
                "SELECT status, count(*) FROM samples GROUP BY status").fetchall(),
            "leases": one("""
                SELECT count(*), coalesce(extract(epoch FROM now() - min(created_at)), 0),
                       count(*) FILTER (WHERE expires_at < now())
                FROM leases WHERE ended IS NULL"""),
            "expiries": one("SELECT count(*) FROM leases WHERE ended = 'expired'"),
            "step": one(f"""
                SELECT ({data}->'metrics'->>'step_seconds')::float8,
                       ({data}->'metrics'->>'trainable_tokens')::float8
                FROM events WHERE type = 'policy_updated' ORDER BY position DESC LIMIT 1"""),
        }


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_text, value=value)


def _labelled(name: str, help_text: str, label: str, values: Iterable[tuple[str, float]]
              ) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, help_text, labels=[label])
    for key, value in values:
        family.add_metric([key], value)
    return family


class StoreCollector(Collector):
    """The store's figures, read from the database at every scrape."""

    def __init__(self, store: EventStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        f = _figures(self.store)
        events = CounterMetricFamily("trajstore_events", "Events stored, by type.",
                                     labels=["type"])
        for event_type, n in f["by_type"]:
            events.add_metric([event_type], n)
        yield events
        episodes = dict.fromkeys(EPISODE_STATUSES, 0)
        episodes.update({status: n for status, n in f["episodes"]})
        episodes["running"] = f["running"][0] if f["running"] else 0
        yield _labelled("trajstore_episodes", "Episodes by status: running (started, not "
                        "finished), or the status replay gave them (finished episodes not "
                        "replayed yet are trajstore_replay_lag_episodes).", "status",
                        episodes.items())
        lag = f["lag"] or (0, 0.0)
        yield _gauge("trajstore_replay_lag_episodes", "Finished episodes not projected yet.",
                     lag[0])
        yield _gauge("trajstore_replay_lag_seconds",
                     "Age of the oldest finished episode not projected yet.", float(lag[1]))
        yield _labelled("trajstore_follower_lag_events", "Events in the log that a follower "
                        "of the log (the replay dispatcher) has not acted on yet.", "follower",
                        ((name, n) for name, n, _ in f["followers"]))
        yield _labelled("trajstore_follower_lag_seconds", "Age of the oldest event a "
                        "follower of the log has not acted on yet (0 when caught up).",
                        "follower", ((name, float(s)) for name, _, s in f["followers"]))
        samples = dict.fromkeys(SAMPLE_STATUSES, 0)
        samples.update({s: n for s, n in f["samples"]})
        yield _labelled("trajstore_samples", "Samples by status.", "status", samples.items())
        live, oldest, overdue = f["leases"] or (0, 0.0, 0)
        yield _gauge("trajstore_leases_active", "Leases neither acknowledged, released nor "
                     "expired.", live)
        yield _gauge("trajstore_lease_oldest_age_seconds",
                     "Age of the oldest active lease (0 when none).", float(oldest))
        yield _gauge("trajstore_leases_overdue", "Active leases past their expiry that no "
                     "expiry has ended yet.", overdue)
        expiries = CounterMetricFamily(
            "trajstore_lease_expiries",
            "Leases that expired before their trainer acknowledged them.",
            value=f["expiries"][0] if f["expiries"] else 0)
        yield expiries
        seconds, tokens = f["step"] or (None, None)
        yield _gauge("trajstore_trainer_step_seconds", "Duration of the newest training step.",
                     seconds or 0.0)
        yield _gauge("trajstore_trainer_tokens_per_second",
                     "Trainable tokens per second of the newest training step.",
                     (tokens / seconds) if seconds and tokens else 0.0)


def registry(store: EventStore, *collectors: Collector) -> CollectorRegistry:
    """A registry of the store's figures, this process's append latency and ``collectors``
    (nothing is read until it is scraped)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(StoreCollector(store))
    reg.register(APPEND_LATENCY)
    for collector in collectors:
        reg.register(collector)
    return reg


def render(store: EventStore, *collectors: Collector) -> str:
    """Every metric (and those of ``collectors``) in the Prometheus text exposition format,
    version 0.0.4 (:data:`CONTENT_TYPE`)."""
    return generate_latest(registry(store, *collectors)).decode()
