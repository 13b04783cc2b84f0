"""``trajstore up``: the API, one worker per queue and the periodic sweep, supervised.

The parent starts the embedded PostgreSQL and Redis (unless the settings name servers) and
hands their URLs to the children, so every child uses the same ones and they stop when the
parent does. Children's output is merged into one stream, each line prefixed with the child's
name. Ctrl-C (SIGINT) or SIGTERM stops every child and exits 0; a child that dies on its own
stops the rest and makes ``up`` exit with status 1.

Nothing outlives ``up``, whatever kills it: each child gets SIGTERM from the kernel when
``up`` dies (``trajstore.processes.die_with_parent``), and a watchdog in a session of its own
(``trajstore.watchdog``) stops the children's process groups and the embedded servers ``up``
started when ``up`` dies without saying it stopped them. ``up`` and its children register
in the data directory, so ``trajstore stop`` finds them too.
"""

from __future__ import annotations

import contextlib
import functools
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO

import psutil

from store import embedded, migrate, preflight
from store.settings import Settings
from trajstore.launch import child_environment
from trajstore.processes import die_with_parent, register

__all__ = ["Child", "child_env", "default_children", "supervise"]


@dataclass(frozen=True)
class Child:
    name: str
    args: tuple[str, ...]


def default_children(*, with_api: bool) -> list[Child]:
    """What ``up`` runs: the API (when the api package is installed), a worker per queue, and
    the sweep."""
    children = []
    if with_api:
        # The replay worker replays; the API's own copy of the follower would race it.
        children.append(Child("api", ("serve", "--no-replay")))
    children += [
        # REPLAY_PROJECT_RUNNING + 1 slots (two by default): a project holding all its
        # places leaves one to another project's episode.
        Child("replay", ("worker", "--queues", "replay")),
        Child("rollout", ("worker", "--queues", "rollout")),
        Child("train", ("worker", "--queues", "train")),
        Child("sweep", ("sweep",)),
    ]
    return children


def child_env(settings: Settings) -> dict[str, str]:
    """The environment of a child process: the parent's, with the database and Redis URLs
    it resolved (starting the embedded servers when the settings name none), and the
    child running the parent's code (``trajstore.launch.child_environment``), and the API's
    own address as the store's URL for runs' RolloutServers unless the settings name one
    (``remote_agent_store_url``). A server that
    does not answer is a ``ConfigurationError`` naming its setting."""
    env = child_environment()
    env["TRAJSTORE_DATABASE_URL"] = preflight.database_url(settings)
    env["TRAJSTORE_REDIS_URL"] = preflight.broker_url(settings)
    env["TRAJSTORE_DATA_DIR"] = str(settings.data_dir)
    if settings.remote_agent_store_url is None:
        # A run's own RolloutServer reaches the API ``up`` runs (on this machine unless the
        # setting names the address it has from there).
        host = settings.api_host if settings.api_host not in ("0.0.0.0", "::", "") \
            else "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        env["TRAJSTORE_REMOTE_AGENT_STORE_URL"] = f"http://{host}:{settings.api_port}"
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def supervise(settings: Settings, children: Sequence[Child], *, out: IO[str] | None = None,
              grace_s: float = 20.0) -> int:
    """Run ``children`` (``trajstore`` subcommands) until Ctrl-C or until one dies. Returns
    the exit status for ``up``: 0 after a requested stop, 1 when a child died."""
    out = out or sys.stdout
    register(settings.data_dir, "up")
    watchdog = subprocess.Popen([sys.executable, "-m", "trajstore.watchdog"],
                                stdin=subprocess.PIPE, start_new_session=True)
    assert watchdog.stdin is not None
    tell = functools.partial(_tell, watchdog.stdin)
    redis_was_running = embedded.embedded_redis_running(settings)
    try:
        env = child_env(settings)
        if settings.redis_url is None and not redis_was_running:
            tell("redis")
        migrate.upgrade(env["TRAJSTORE_DATABASE_URL"])
    except BaseException:
        watchdog.stdin.close()  # the watchdog stops the Redis started here
        raise
    procs: dict[str, subprocess.Popen[bytes]] = {}
    selector = selectors.DefaultSelector()
    for child in children:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trajstore", *child.args], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=functools.partial(die_with_parent, os.getpid()),
        )
        with contextlib.suppress(psutil.Error):  # one that is gone already is not watched
            tell(f"child {proc.pid} {psutil.Process(proc.pid).create_time()}")
        procs[child.name] = proc
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        selector.register(proc.stdout, selectors.EVENT_READ, child.name)
    width = max(len(c.name) for c in children)
    stop_requested = False

    def request_stop(signum: int, frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True

    previous = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    status = 0
    buffers: dict[str, bytes] = {name: b"" for name in procs}

    def pump(timeout: float) -> None:
        for key, _ in selector.select(timeout):
            name = key.data
            try:
                chunk = key.fileobj.read()  # type: ignore[union-attr]
            except (BlockingIOError, ValueError):
                continue
            if not chunk:
                selector.unregister(key.fileobj)
                continue
            buffers[name] += chunk
            *lines, buffers[name] = buffers[name].split(b"\n")
            for line in lines:
                out.write(f"{name:<{width}} | {line.decode(errors='replace')}\n")
            out.flush()

    try:
        while not stop_requested:
            pump(0.5)
            dead = [n for n, p in procs.items() if p.poll() is not None]
            if dead:
                for name in dead:
                    out.write(f"{name:<{width}} | exited with status {procs[name].returncode};"
                              " stopping the others\n")
                status = 1
                break
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
            pump(0.2)
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        pump(0)
        for s, handler in previous.items():
            signal.signal(s, handler)
        out.flush()
        tell("done")
        watchdog.stdin.close()
        watchdog.wait()
    return status


def _tell(pipe: IO[bytes], line: str) -> None:
    """One line to the watchdog; a watchdog that is gone is not worth stopping ``up`` for."""
    try:
        pipe.write(f"{line}\n".encode())
        pipe.flush()
    except (BrokenPipeError, ValueError):
        pass
