"""The Celery configuration turns task events on, so `celery inspect` and Flower work."""

from __future__ import annotations

from celery import Celery

from store.settings import Settings
from workers.app import configure


def test_task_events_are_on() -> None:
    celery = Celery("trajstore-test")
    configure(celery, Settings(redis_url="redis://127.0.0.1:6379/13"))
    assert celery.conf.worker_send_task_events is True
    assert celery.conf.task_send_sent_event is True
    assert celery.conf.task_routes["trajstore.train_step"] == {"queue": "train"}


def test_redis_urls_get_the_guarded_transport() -> None:
    """Every spelling of the broker's URL (TCP, TLS, the embedded server's unix socket) is
    served by the transport that keeps a worker alive when Redis goes away under an
    unacknowledged task (``workers.redis_transport``; the outage itself is
    ``tests/faults/test_worker_faults.py``)."""
    from workers import redis_transport

    for url in ("redis://127.0.0.1:6379/13", "rediss://127.0.0.1:6380/0",
                "redis+socket:///tmp/trajstore-none.sock"):
        celery = Celery("trajstore-test")
        configure(celery, Settings(redis_url=url))
        with celery.connection_for_write() as connection:
            assert type(connection.transport) is redis_transport.Transport, url
            assert connection.transport.Channel is redis_transport.Channel
