"""The processes of a data directory: which run, how each child dies with its parent, and
how they all stop.

Every long-running command (``up``, ``serve``, ``worker``, ``sweep``, ``demo``) registers
itself in ``<data_dir>/processes/<pid>.json`` and removes the file when it exits;
``trajstore stop`` reads the directory and stops every process still running there, whatever
started it. A record names the process by pid *and* start time (psutil's ``create_time``), so
a pid the system gave to another process since is never signalled; a record whose process is
gone is dropped the next time the directory is read.

A child started with :func:`die_with_parent` as its ``preexec_fn`` gets SIGTERM from the
kernel when its parent dies, even by SIGKILL (Linux's ``PR_SET_PDEATHSIG``; elsewhere the
call does nothing and the supervisor's watchdog, ``trajstore.watchdog``, is what remains).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

__all__ = ["Registered", "die_with_parent", "register", "registered", "stop_processes",
           "stop_tree"]

_DIRECTORY = "processes"


@dataclass(frozen=True)
class Registered:
    """A running trajstore process of a data directory."""

    pid: int
    created: float
    command: str

    def describe(self) -> str:
        return f"trajstore {self.command} (pid {self.pid})"


def _directory(data_dir: Path) -> Path:
    return Path(data_dir).expanduser() / _DIRECTORY


def register(data_dir: Path, command: str) -> Path:
    """Record this process as running ``command`` in ``data_dir`` until it exits; returns
    the record's path. A data directory that cannot be written is an ``OSError``."""
    folder = _directory(data_dir)
    folder.mkdir(parents=True, exist_ok=True)
    me = psutil.Process()
    path = folder / f"{me.pid}.json"
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps({"pid": me.pid, "created": me.create_time(),
                                   "command": command}))
    partial.replace(path)  # a reader never sees half a record
    atexit.register(_unregister, path, me.pid)
    return path


def _unregister(path: Path, pid: int) -> None:
    if os.getpid() == pid:  # not in a forked child that inherited the atexit hook
        with contextlib.suppress(OSError):
            path.unlink()


def _process(pid: int, created: float) -> psutil.Process | None:
    """The process ``pid`` if it is still the one that started at ``created``."""
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - created) > 0.01 or proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except psutil.Error:
        return None


def registered(data_dir: Path) -> list[Registered]:
    """The registered processes of ``data_dir`` that are still running, oldest first.
    Records of processes that are gone, and records that cannot be read, are removed."""
    folder = _directory(data_dir)
    found = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            record = json.loads(path.read_text())
            entry = Registered(int(record["pid"]), float(record["created"]),
                               str(record["command"]))
        except (OSError, ValueError, KeyError, TypeError):
            entry = None
        if entry is None or _process(entry.pid, entry.created) is None:
            with contextlib.suppress(OSError):
                path.unlink()
            continue
        found.append(entry)
    return sorted(found, key=lambda e: e.created)


def stop_tree(pid: int, created: float, *, grace_s: float) -> bool:
    """Stop the process ``pid`` (if it is still the one started at ``created``) and every
    process below it: SIGTERM to each, SIGKILL to whatever is left after ``grace_s``. A
    process that leads its own process group has the whole group signalled, which reaches
    descendants that were re-parented away from it. True when there was something to stop."""
    root = _process(pid, created)
    if root is None:
        return False
    try:
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        tree = [root]
    leads_group = _leads_group(pid)
    _signal_all(tree, pid, leads_group, signal.SIGTERM)
    alive = _outlive(tree, grace_s)
    if alive or (leads_group and _group_alive(pid)):
        _signal_all(alive, pid, leads_group, signal.SIGKILL)
        _outlive(alive, 10.0)
    return True


def _running(proc: psutil.Process) -> bool:
    """Whether ``proc`` still runs. A zombie does not: it has exited and waits only for its
    parent (a process other than this one) to collect its status."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _pid_running(pid: int) -> bool:
    try:
        return _running(psutil.Process(pid))
    except psutil.Error:
        return False


def _outlive(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait up to ``timeout_s`` for ``procs`` to exit (collecting those that are this
    process's children); returns those still running. psutil's own wait counts a zombie as
    running until its parent collects it, so stopping the processes another program started
    (and has not collected yet) took the whole grace period."""
    deadline = time.monotonic() + timeout_s
    while True:
        psutil.wait_procs(procs, timeout=0)  # collects this process's children that exited
        alive = [p for p in procs if _running(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.1)


def _leads_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except OSError:
        return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except OSError:
        return False
    return True


def _signal_all(procs: list[psutil.Process], pid: int, leads_group: bool,
                sig: signal.Signals) -> None:
    if leads_group:
        with contextlib.suppress(OSError):
            os.killpg(pid, sig)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)


def stop_processes(data_dir: Path, *, grace_s: float = 30.0,
                   exclude: int | None = None) -> list[str]:
    """Stop every registered process of ``data_dir`` (but ``exclude``, a pid), newest first
    so that supervisors do not restart what was just stopped, each with everything it
    started. Returns what was stopped, one description each."""
    stopped = []
    for entry in reversed(registered(data_dir)):
        if entry.pid == exclude:
            continue
        if stop_tree(entry.pid, entry.created, grace_s=grace_s):
            stopped.append(entry.describe())
    return stopped


def die_with_parent(parent_pid: int | None = None) -> None:
    """Ask the kernel to send this process SIGTERM when its parent dies, whatever kills the
    parent (run in the child, as ``subprocess.Popen``'s ``preexec_fn``; only Linux has
    it). When the parent is already gone by then, the child stops at once."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGTERM)


def wait_gone(pids: list[int], timeout_s: float) -> bool:
    """Whether every one of ``pids`` has exited within ``timeout_s`` (a zombie has)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(_pid_running(p) for p in pids):
            return True
        time.sleep(0.1)
    return False
