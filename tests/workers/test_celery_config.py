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
