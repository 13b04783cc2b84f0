"""How many tasks wait in each Celery queue (``workers.app.QUEUES``), read from the broker,
and a Prometheus collector of it for ``/metrics``.

The broker is the Redis the settings name (or the embedded one), with the workers' key
prefix; a queue's depth is what kombu counts for it (the lengths of its Redis lists, one per
priority step). Tasks a worker has taken and not acknowledged yet are not waiting and are not
counted.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from workers.app import QUEUES

__all__ = ["QueueCollector", "queue_depths"]


def queue_depths(settings: Any, *, timeout_s: float = 2.0) -> dict[str, int]:
    """Tasks waiting in each queue of ``QUEUES`` (0 for a queue the broker has never seen).
    Raises kombu's ``OperationalError`` (or the transport's connection error) when the broker
    cannot be reached within ``timeout_s``, and ConnectionError when the settings name no
    Redis and the embedded one is not running (it is never started from here)."""
    from kombu import Connection

    from store import embedded

    if not settings.redis_url and not embedded.embedded_redis_running(settings):
        raise ConnectionError(f"the embedded Redis of {settings.data_dir} is not running")
    url = embedded.redis_url(settings)
    options = {"global_keyprefix": settings.redis_key_prefix}
    out: dict[str, int] = {}
    with Connection(url, transport_options=options, connect_timeout=timeout_s) as conn:
        conn.ensure_connection(max_retries=1, timeout=timeout_s)
        channel = conn.default_channel
        for name in QUEUES:
            # The Redis channel's own count (its lists of every priority step, 0 for none).
            # A passive queue_declare would be the public way, but with a global key prefix
            # kombu looks for the unprefixed lists and answers NOT_FOUND.
            out[name] = int(channel._size(name))
    return out


class QueueCollector(Collector):
    """``trajstore_queue_depth{queue}`` and ``trajstore_broker_up`` at every scrape; a broker
    that cannot be reached gives ``trajstore_broker_up 0`` and no depths, not a failed
    scrape."""

    def __init__(self, settings: Any, *, timeout_s: float = 2.0) -> None:
        self.settings = settings
        self.timeout_s = timeout_s

    def collect(self) -> Iterator[Metric]:
        try:
            depths: dict[str, int] | None = queue_depths(self.settings,
                                                         timeout_s=self.timeout_s)
        except Exception:  # noqa: BLE001 - any broker failure is "down" on this page
            depths = None
        yield GaugeMetricFamily("trajstore_broker_up", "1 when the Celery broker (Redis) "
                                "answered this scrape, else 0.", value=int(depths is not None))
        family = GaugeMetricFamily("trajstore_queue_depth", "Tasks waiting in each Celery "
                                   "queue (taken and unacknowledged ones not counted).",
                                   labels=["queue"])
        for name, n in (depths or {}).items():
            family.add_metric([name], n)
        yield family
