"""What a replay loads, loaded ahead: a replay worker imports it in its main process before
the pool forks (``workers.celery_tasks``), so that every pool process starts with it.

A replay loads the run's tokenizer through transformers, which imports torch, tokenizers and
its tokenizer classes on first use: about three seconds of CPU on a quiet machine, many more
on a busy one. Done in each pool process on its first replay, that time fell on whichever
episode came first, a neighbour's as likely as anyone's. Imported before the fork, it is
shared by every process (copy-on-write) and each one's first replay costs what any other
does. Nothing here opens a connection or starts a thread, both of which a fork must not
inherit."""

from __future__ import annotations

import importlib
import logging
import time

__all__ = ["REPLAY_MODULES", "import_replay_modules"]

log = logging.getLogger(__name__)

#: The modules a replay imports on first use, heaviest first.
REPLAY_MODULES = (
    "torch",
    "transformers",
    "transformers.tokenization_utils_fast",
    "transformers.models.auto.tokenization_auto",
    "tokenizers",
    "jinja2.sandbox",
    "workers.engines.render",
    "workers.engines.tokenizers",
    "workers.replay.jobs.project",
)


def import_replay_modules() -> list[str]:
    """Import :data:`REPLAY_MODULES`; returns those that could not be imported (logged, not
    raised: a missing optional package makes the first replay say so, as it would
    anyway)."""
    start = time.monotonic()
    missing = []
    for name in REPLAY_MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # ImportError, or a package that fails as it loads
            missing.append(name)
            log.warning("replay warm-up: %s could not be imported (%s)", name, exc)
    log.info("replay warm-up: imported what a replay loads in %.1f s",
             time.monotonic() - start)
    return missing
