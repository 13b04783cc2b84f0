"""The one way tests start a server: a free port, a readiness check, and a stop that always
runs.

- :class:`ServerProcess`: a command (``trajstore serve``, a vLLM server) in a process group of
  its own, its output in a log file; ready when ``GET <url><ready_path>`` answers 200; a
  process that exits before that fails the test with the log's tail. ``stop`` ends the whole
  group (SIGTERM, then SIGKILL).
- :class:`ThreadedServer`: an ASGI app on uvicorn in a thread of the test process (an API
  over the test's own store, a fake trainer endpoint); ready when uvicorn says it started.
- :func:`vllm_server`: vLLM's OpenAI-compatible server over a model folder, as a
  :class:`ServerProcess`.

Both are context managers; ``start()`` returns the server once it is ready.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import httpx

__all__ = ["ServerProcess", "ThreadedServer", "free_port", "trajstore_serve", "vllm_server"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class ServerProcess:
    """``command`` (which must listen on ``port``) as a server process (module docstring).
    ``env`` is the whole environment of the process (the test's when None)."""

    def __init__(self, command: Sequence[str], *, port: int, log: Path,
                 env: Mapping[str, str] | None = None, ready_path: str = "/health",
                 timeout_s: float = 120.0) -> None:
        self.command = list(command)
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log
        self.env = dict(env) if env is not None else dict(os.environ)
        self.ready_path = ready_path
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> ServerProcess:
        """Start the process and wait until it is ready; raises AssertionError (with the
        log's tail) when it exits first or is not ready within ``timeout_s``. A stopped
        server may be started again (on the same port)."""
        self.launch()
        self.wait_ready()
        return self

    def launch(self) -> None:
        """Start the process without waiting (:meth:`wait_ready` waits)."""
        self._log = open(self.log_path, "ab")  # noqa: SIM115  (closed by stop)
        self.proc = subprocess.Popen(self.command, env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def log_tail(self, size: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-size:] if self.log_path.exists() \
            else ""

    def wait_ready(self, timeout: float | None = None) -> None:
        """Poll ``ready_path`` until it answers 200 (see :meth:`start`)."""
        assert self.proc is not None, "the server was not started"
        deadline = time.monotonic() + (timeout if timeout is not None else self.timeout_s)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}: "
                                     f"{self.log_tail()}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"server not ready within the time allowed: {self.log_tail()}")

    def stop(self) -> None:
        """End the process group (SIGTERM, SIGKILL after 30 s) and close the log."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> ServerProcess:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


def trajstore_serve(*, env: Mapping[str, str], log: Path, timeout_s: float = 120.0,
                    replay: bool = False) -> ServerProcess:
    """``trajstore serve`` on a free port with ``env`` (not yet started); it replays the
    episodes it ingests only with ``replay``."""
    port = free_port()
    return ServerProcess([sys.executable, "-m", "trajstore", "serve", "--host", "127.0.0.1",
                          "--port", str(port), "--replay" if replay else "--no-replay"],
                         port=port, log=log, env=env, timeout_s=timeout_s)


class ThreadedServer:
    """``app`` served by uvicorn in a daemon thread on a free port (module docstring)."""

    def __init__(self, app: Any, *, timeout_s: float = 30.0, **config: Any) -> None:
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.timeout_s = timeout_s
        options: dict[str, Any] = {"log_level": "error", **config}
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    **options))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> ThreadedServer:
        """Start serving; raises AssertionError when uvicorn has not started in time."""
        self.thread.start()
        deadline = time.monotonic() + self.timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise AssertionError(f"the server on port {self.port} did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout=30)

    def __enter__(self) -> ThreadedServer:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def vllm_server(model_dir: Path, directory: Path, *, served_name: str = "tiny",
                timeout_s: float = 300.0, env: dict[str, str] | None = None
                ) -> Iterator[str]:
    """vLLM's OpenAI-compatible server over ``model_dir`` on the CPU settings the vLLM tests
    use (float32, eager, ``processed_logprobs``), logging to ``directory``, with ``env``
    added to its environment; yields its URL."""
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CACHE_ROOT": str(directory / "cache"), **(env or {})}
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(model_dir), "--served-model-name", served_name,
               "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
               "--host", "127.0.0.1", "--port", str(port),
               "--logprobs-mode", "processed_logprobs"]
    with ServerProcess(command, port=port, log=directory / "server.log", env=env,
                       ready_path="/v1/models", timeout_s=timeout_s) as server:
        yield server.url
