"""The Python sandbox: a real child process with time, memory, output and network limits."""

from __future__ import annotations

import pytest

from workers.rollout.sandbox import PythonSandbox, PythonTool


@pytest.fixture(scope="module")
def sandbox() -> PythonSandbox:
    return PythonSandbox(timeout_s=2.0, memory_bytes=256 * 1024 * 1024, max_output_chars=200)


def test_prints_and_last_expression(sandbox: PythonSandbox) -> None:
    result = sandbox.run("print('hi')\nx = 6\nx * 7")
    assert result.ok and result.output == "hi\n42\n"
    assert not result.truncated


@pytest.mark.parametrize(("code", "error_type"), [
    ("print(undefined_name)", "NameError"),
    ("def f(:\n    pass", "SyntaxError"),
    ("if True:\nprint(1)", "IndentationError"),
    ("import no_such_module_here", "ModuleNotFoundError"),
    ("from math import no_such_name", "ImportError"),
    ("1 / 0", "ZeroDivisionError"),
    ("raise SystemExit(3)", "SystemExit"),
])
def test_errors_report_python_exception_type(sandbox: PythonSandbox, code: str,
                                             error_type: str) -> None:
    result = sandbox.run(code)
    assert result.error_type == error_type
    assert error_type in result.output


def test_clean_exit_is_success(sandbox: PythonSandbox) -> None:
    result = sandbox.run("print('bye')\nraise SystemExit(0)")
    assert result.ok and result.output == "bye\n"


def test_wall_clock_limit_kills_the_process(sandbox: PythonSandbox) -> None:
    result = sandbox.run("import time\nprint('start', flush=True)\nwhile True:\n    pass")
    assert result.error_type == "TimeoutError"
    assert "time limit of 2 s" in result.error_message
    assert result.output.startswith("start\n")


def test_memory_limit(sandbox: PythonSandbox) -> None:
    result = sandbox.run("block = bytearray(512 * 1024 * 1024)\nprint('allocated')")
    assert result.error_type == "MemoryError"
    assert "allocated" not in result.output
    assert sandbox.run("block = bytearray(16 * 1024 * 1024)\nprint(len(block))").ok


def test_output_is_truncated(sandbox: PythonSandbox) -> None:
    result = sandbox.run("print('x' * 1000)")
    assert result.ok and result.truncated
    assert result.output.startswith("x" * 200)
    assert "[output truncated, 801 more characters]" in result.output


def test_file_size_limit() -> None:
    small = PythonSandbox(timeout_s=2.0, max_file_bytes=1024)
    result = small.run("open('big', 'w').write('y' * 100000)")
    assert result.error_type == "OSError"


@pytest.mark.parametrize("network", ["auto", "block-sockets"])
def test_no_network(network: str) -> None:
    isolated = PythonSandbox(timeout_s=3.0, network=network)
    code = ("import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n"
            "s.settimeout(1)\ns.connect(('1.1.1.1', 53))\nprint('connected')")
    result = isolated.run(code)
    assert "connected" not in result.output
    assert result.error_type in ("OSError", "PermissionError", "TimeoutError")
    assert isolated.network_isolation in ("namespace", "socket-blocked")
    if network == "block-sockets":
        assert isolated.network_isolation == "socket-blocked"
        assert result.error_type == "PermissionError"


def test_code_runs_in_an_empty_isolated_folder(sandbox: PythonSandbox) -> None:
    result = sandbox.run("import os, sys\nprint(os.listdir('.'), '' in sys.path)")
    assert result.ok and result.output.strip() == "[] False"


def test_python_tool_outcomes() -> None:
    tool = PythonTool(PythonSandbox(timeout_s=2.0))
    assert tool({"code": "print(2 + 2)"}).output == "4\n"
    failed = tool({"code": "undefined"})
    assert failed.is_error and failed.error_type == "NameError"
    assert "name 'undefined' is not defined" in failed.error_message
    assert tool({"code": 5}).error_type == "ToolArgumentError"


def test_bad_limits_are_named() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        PythonSandbox(timeout_s=0)
    with pytest.raises(ValueError, match="memory_bytes"):
        PythonSandbox(memory_bytes=-1)
    with pytest.raises(ValueError, match="network"):
        PythonSandbox(network="off")
    with pytest.raises(TypeError, match="code must be a str"):
        PythonSandbox().run(None)  # type: ignore[arg-type]
