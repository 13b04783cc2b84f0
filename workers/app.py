"""The Celery application: broker from settings (Redis; the embedded one by default).

Queues: ``replay`` (replay and the sweep), ``rollout`` (groups and remote rollouts),
``train``. Tasks acknowledge late and prefetch one at a time, so a task whose worker dies is
delivered again (tasks are idempotent; remote rollouts, which cannot be resumed, are the
exception: ``workers.rollout.celery_tasks``); the broker's visibility timeout
(``TRAJSTORE_VISIBILITY_TIMEOUT_S``) must stay longer than the longest task. No result
backend: tasks never wait on each other's results.
The application configures itself from the TRAJSTORE_* settings when it is first used, and
task events are on, so Celery's own tools (``celery -A workers.app inspect ping``, ``celery -A
workers.app events``, Flower) work against a running ``trajstore up`` given its settings.
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.signals import setup_logging

from store.settings import get_settings
from workers import redis_transport

__all__ = ["app", "QUEUES", "celery_settings", "configure", "ensure_configured"]

QUEUES = ("replay", "rollout", "train")

# Before any connection is made: the Redis URLs get kombu's transport with the guard that
# keeps a worker alive when the broker goes away under an unacknowledged task.
redis_transport.install()

app = Celery("trajstore", include=["workers.celery_tasks", "workers.rollout.celery_tasks"])
_configured = False


def celery_settings(settings: Any, broker_url: str) -> dict[str, Any]:
    """The Celery configuration of trajstore's queues for ``settings``, with ``broker_url``:
    the delivery guarantees described above, the routes, the sweep's schedule, and the
    broker's key prefix, which every client of the queues (workers, producers, and Celery's
    own ``inspect``, ``events`` and Flower) must share to see the same queues and replies."""
    return {
        "broker_url": broker_url,
        "result_backend": None,
        "task_ignore_result": True,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "task_default_queue": "replay",
        "task_routes": {
            "trajstore.replay_episode": {"queue": "replay"},
            "trajstore.sweep": {"queue": "replay"},
            "trajstore.rollout_group": {"queue": "rollout"},
            "trajstore.remote_rollout": {"queue": "rollout"},
            "trajstore.remote_rollout_init": {"queue": "rollout"},
            "trajstore.branch_episode": {"queue": "rollout"},
            "trajstore.train_step": {"queue": "train"},
        },
        "broker_transport_options": {
            "visibility_timeout": settings.visibility_timeout_s,
            "global_keyprefix": settings.redis_key_prefix,
        },
        "broker_connection_retry_on_startup": True,
        "beat_schedule": {
            "sweep": {"task": "trajstore.sweep", "schedule": settings.sweep_interval_s},
        },
        "worker_hijack_root_logger": False,
        # Task events on, so `celery -A workers.app events` and Flower can watch a running
        # `trajstore up` (docs/deploy.md).
        "worker_send_task_events": True,
        "task_send_sent_event": True,
    }


def configure(celery: Celery, settings: Any = None) -> None:
    """Point ``celery`` at the broker the settings name (starting the embedded Redis when
    they name none) and set the delivery guarantees described above."""
    from store import embedded

    global _configured
    settings = settings or get_settings()
    url = embedded.redis_url(settings)
    if celery is app:
        # Before the configuration is first read: its defaults then stay empty instead of
        # resolving the process settings' broker (and maybe starting an embedded Redis).
        _configured = True
    # Forget connections to a broker configured earlier: the connection pool and the
    # producer pool are cached on first use.
    celery.close()
    celery.amqp._producer_pool = None
    celery.conf.update(celery_settings(settings, url))


def _defaults_from_settings() -> dict[str, Any]:
    """What the application reads when nothing configured it: the process settings
    (TRAJSTORE_*). This is how Celery's own command line (``celery -A workers.app inspect
    ping``, ``events``, Flower) finds the broker, its key prefix and the queues of a running
    ``trajstore up``; a broker given with ``celery -b`` takes precedence over the URL."""
    from store import embedded

    if _configured:
        return {}
    settings = get_settings()
    return celery_settings(settings, embedded.redis_url(settings))


app.add_defaults(_defaults_from_settings)


def ensure_configured() -> Celery:
    """The application, configured from the process settings unless ``configure`` ran."""
    if not _configured:
        configure(app)
    return app


@setup_logging.connect
def _logging(**_: Any) -> None:
    """Workers log like every other trajstore process (TRAJSTORE_LOG_FORMAT text or json);
    a receiver here also stops Celery from installing its own handlers. The tokenizer cache
    takes its size (tokenizer_cache_size) here too: the worker's first setting read."""
    from store.logs import configure_logging
    from workers.engines.tokenizers import configure as configure_tokenizers

    configure_logging(get_settings())
    configure_tokenizers(cache_size=get_settings().tokenizer_cache_size)
