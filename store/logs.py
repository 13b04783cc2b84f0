"""Logging for every trajstore process: plain text, or one JSON object per line."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os

from store.settings import Settings

__all__ = ["NOISY_LIBRARIES", "JsonFormatter", "configure_logging"]

# Libraries whose INFO lines say nothing a user of a command needs (every migration step,
# every pg_ctl call); the command line shows them only with ``-v``.
NOISY_LIBRARIES = ("alembic", "pgserver", "httpx", "urllib3", "multipart")

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, process, and any ``extra``
    fields; the exception's traceback under ``exc_info``."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": record.processName if record.processName != "MainProcess"
            else os.getpid(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


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
