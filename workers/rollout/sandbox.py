"""Running model-written Python code in a separate, limited process (the ``python`` tool).

Each run starts a fresh interpreter (``python -I``: no user site, no ``PYTHONPATH``, no current
folder on the path) in an empty temporary working folder with a minimal environment. Before the
code runs, the child process:

1. leaves the network: it moves itself into a new, empty network namespace with
   ``unshare(CLONE_NEWNET)``, or, without the privilege for that, into a new user namespace
   plus network namespace. When neither is permitted (some containers forbid namespaces) it
   falls back to replacing ``socket.socket`` and ``socket.create_connection`` with functions
   that raise PermissionError. That fallback stops ordinary code but not code that loads a
   C library to call ``socket(2)`` directly; :attr:`PythonSandbox.network_isolation` tells
   which mode is in effect ("namespace" or "socket-blocked");
2. limits itself with ``resource.setrlimit``: address space (``memory_bytes``), CPU seconds,
   size of files written (the combined stdout/stderr file included) and no core dumps.

The parent enforces the wall-clock limit, killing the child's whole process group. Output
(stdout and stderr interleaved, as a terminal would show them) is truncated to
``max_output_chars``. When the last statement is an expression its value is printed, as in a
notebook. A failed run reports Python's exception type name (``NameError``, ``SyntaxError``,
``MemoryError``…) as ``error_type``; a run past the wall-clock or CPU limit reports
``TimeoutError``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from workers.rollout.tools import ToolOutcome, function_schema

__all__ = ["PythonSandbox", "PythonTool", "SandboxResult"]

_RUNNER = r'''
import ast, ctypes, json, os, resource, signal, sys, traceback
config = json.loads(sys.argv[1])
result_fd = config["result_fd"]
isolation = "socket-blocked"
try:
    if config["network"] != "auto":
        raise PermissionError("namespaces not requested")
    libc = ctypes.CDLL(None, use_errno=True)
    CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
    if libc.unshare(CLONE_NEWNET) == 0 or libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        isolation = "namespace"
except Exception:
    pass
if isolation != "namespace":
    import socket
    def _refuse(*args, **kwargs):
        raise PermissionError("network access is disabled in this sandbox")
    socket.socket = _refuse
    socket.create_connection = _refuse
    socket.socketpair = _refuse
limits = [(resource.RLIMIT_AS, config["memory_bytes"]),
          (resource.RLIMIT_CPU, config["cpu_seconds"]),
          (resource.RLIMIT_FSIZE, config["file_bytes"]), (resource.RLIMIT_CORE, 0)]
for kind, value in limits:
    resource.setrlimit(kind, (value, value))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
code = sys.stdin.read()
sys.stdin.close()
report = {"isolation": isolation, "error_type": None, "error_message": None}
namespace = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    tree = ast.parse(code, filename="<code>", mode="exec")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "<code>", "exec"), namespace)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), "<code>", "eval"), namespace)
        if value is not None:
            print(repr(value))
except SystemExit as exc:
    if exc.code not in (0, None):
        report["error_type"] = "SystemExit"
        report["error_message"] = f"exit status {exc.code}"
except BaseException as exc:
    error = exc
    report["error_type"] = type(error).__name__
    report["error_message"] = str(error)[:2000]
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != "<code>":
        tb = tb.tb_next
    sys.stdout.flush()
    traceback.print_exception(type(error), error, tb, file=sys.stderr)
finally:
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(result_fd, json.dumps(report).encode())
'''


@dataclass(frozen=True)
class SandboxResult:
    """One run: combined ``output`` (truncated), the error type/message when the code failed,
    whether the output was truncated, the network isolation mode and the wall time."""

    output: str
    error_type: str | None
    error_message: str | None
    truncated: bool
    isolation: str | None
    duration_s: float

    @property
    def ok(self) -> bool:
        """True when the code ran to the end without an exception."""
        return self.error_type is None


def _positive(value: float, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


class PythonSandbox:
    """Runs code in a limited child process (module docstring).

    ``timeout_s`` wall-clock seconds, ``memory_bytes`` address-space limit, ``cpu_seconds``
    CPU limit (defaults to the wall-clock limit rounded up, plus one), ``max_output_chars``
    characters of output kept, ``max_file_bytes`` bytes the child may write to any file.
    ``network`` is "auto" (namespace isolation, socket blocking as the fallback) or
    "block-sockets" (the fallback only). Non-positive limits and an unknown ``network`` raise
    ValueError naming the argument.
    """

    def __init__(
        self,
        *,
        timeout_s: float = 5.0,
        memory_bytes: int = 512 * 1024 * 1024,
        cpu_seconds: int | None = None,
        max_output_chars: int = 4000,
        max_file_bytes: int = 8 * 1024 * 1024,
        network: str = "auto",
        python: str = sys.executable,
    ) -> None:
        if network not in ("auto", "block-sockets"):
            raise ValueError(f"network must be 'auto' or 'block-sockets', got {network!r}")
        self.network = network
        _positive(timeout_s, "timeout_s")
        _positive(memory_bytes, "memory_bytes")
        _positive(max_output_chars, "max_output_chars")
        _positive(max_file_bytes, "max_file_bytes")
        if cpu_seconds is not None:
            _positive(cpu_seconds, "cpu_seconds")
        self.timeout_s = float(timeout_s)
        self.memory_bytes = int(memory_bytes)
        self.cpu_seconds = int(cpu_seconds) if cpu_seconds else int(timeout_s) + 2
        self.max_output_chars = int(max_output_chars)
        self.max_file_bytes = int(max_file_bytes)
        self.python = python
        self.network_isolation: str | None = None

    def run(self, code: str) -> SandboxResult:
        """Run ``code`` and return its result; never raises for failures of the code itself.
        Raises TypeError when ``code`` is not a str."""
        if not isinstance(code, str):
            raise TypeError(f"code must be a str, got {type(code).__name__}")
        started = time.monotonic()
        read_fd, write_fd = os.pipe()
        with tempfile.TemporaryDirectory(prefix="sandbox-") as root:
            workdir = os.path.join(root, "work")
            os.mkdir(workdir)
            output_path = os.path.join(root, "output")
            config = {"result_fd": write_fd, "network": self.network,
                      "memory_bytes": self.memory_bytes, "cpu_seconds": self.cpu_seconds,
                      "file_bytes": self.max_file_bytes}
            env = {"PATH": os.defpath, "HOME": workdir, "PYTHONIOENCODING": "utf-8",
                   "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1",
                   "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
            timed_out = False
            with open(output_path, "wb") as output_file:
                process = subprocess.Popen(
                    [self.python, "-I", "-u", "-c", _RUNNER, json.dumps(config)],
                    stdin=subprocess.PIPE, stdout=output_file, stderr=subprocess.STDOUT,
                    cwd=workdir, env=env, pass_fds=(write_fd,), start_new_session=True,
                )
                os.close(write_fd)
                try:
                    process.communicate(code.encode("utf-8", "surrogatepass"),
                                        timeout=self.timeout_s)
                except subprocess.TimeoutExpired:
                    timed_out = True
                    try:
                        os.killpg(process.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    process.wait()
                try:  # processes the code left behind die with it
                    os.killpg(process.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            report = self._read_report(read_fd)
            output, truncated = self._read_output(output_path)
        duration = time.monotonic() - started
        if report.get("isolation"):
            self.network_isolation = report["isolation"]
        error_type, error_message = report.get("error_type"), report.get("error_message")
        returncode = process.returncode
        if timed_out:
            error_type = "TimeoutError"
            error_message = f"execution exceeded the time limit of {self.timeout_s:g} s"
        elif returncode is not None and returncode < 0 and error_type is None:
            signal_number = -returncode
            if signal_number in (signal.SIGXCPU, signal.SIGKILL):
                error_type = "TimeoutError"
                error_message = f"execution exceeded the CPU limit of {self.cpu_seconds} s"
            else:
                error_type = "SandboxError"
                error_message = f"process ended by signal {signal.Signals(signal_number).name}"
        elif not report and error_type is None:
            error_type = "SandboxError"
            error_message = f"process exited with status {returncode} without a report"
        if error_type is not None and error_type not in output:
            output = (output + ("\n" if output and not output.endswith("\n") else "")
                      + f"{error_type}: {error_message}")
        return SandboxResult(output=output, error_type=error_type, error_message=error_message,
                             truncated=truncated, isolation=report.get("isolation"),
                             duration_s=duration)

    @staticmethod
    def _read_report(read_fd: int) -> dict[str, Any]:
        # Non-blocking: the child has exited, so its report (one small write) is in the pipe
        # already; a descendant that inherited the pipe must not make us wait.
        os.set_blocking(read_fd, False)
        with os.fdopen(read_fd, "rb") as pipe:
            try:
                raw = pipe.read() or b""
            except BlockingIOError:
                raw = b""
        try:
            return json.loads(raw) if raw else {}
        except json.JSONDecodeError:
            return {}

    def _read_output(self, path: str) -> tuple[str, bool]:
        limit = self.max_output_chars
        with open(path, "rb") as file:
            head = file.read(limit * 4 + 4)
            rest = len(file.read())
        text = head.decode("utf-8", errors="replace")
        if len(text) <= limit and rest == 0:
            return text, False
        dropped = len(text) - limit + rest
        return text[:limit] + f"\n... [output truncated, {dropped} more characters]", True


class PythonTool:
    """The ``python`` tool: ``{"code": "print(1 + 1)"}`` → ``"2\\n"``, run in a
    :class:`PythonSandbox`."""

    name = "python"
    schema = function_schema(
        "python",
        description="Run Python code in a sandbox without network access and return what it "
                    "prints (and the value of the last expression).",
        properties={"code": {"type": "string", "description": "Python source code"}},
        required=["code"],
    )

    def __init__(self, sandbox: PythonSandbox | None = None) -> None:
        self.sandbox = sandbox if sandbox is not None else PythonSandbox()

    def __call__(self, arguments: dict[str, Any]) -> ToolOutcome:
        """Run ``arguments["code"]``; failures are outcomes carrying the exception type name."""
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolOutcome.error("ToolArgumentError",
                                     f"python: argument 'code' must be a string, got {code!r}")
        result = self.sandbox.run(code)
        if result.ok:
            return ToolOutcome(output=result.output)
        return ToolOutcome(output=result.output, is_error=True, error_type=result.error_type,
                           error_message=result.error_message)
