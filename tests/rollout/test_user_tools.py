"""The user's tools: a module of plain (and async) functions becomes tools with OpenAI
schemas from their signatures and docstrings; a module's TOOLS list; an MCP server over
JSON-RPC; the errors that name what cannot be loaded or clashes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.rollout.mcp_server import McpServer
from workers.rollout.tool_runner import ToolRunner
from workers.rollout.user_tools import MCPServer, build_registry, module_tools

CALC = '''
import asyncio

async def add(a: float, b: float) -> float:
    """Add two numbers.

    Args:
        a: First number
        b: Second number
    """
    await asyncio.sleep(0)
    return a + b


def multiply(a: float, b: float = 1.0) -> float:
    """Multiply two numbers."""
    return a * b


def divide(a: float, b: float) -> float:
    """Divide a by b."""
    return a / b


def _helper() -> None:
    pass
'''


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_a_module_of_functions_becomes_tools(tmp_path: Path) -> None:
    registry = build_registry(modules=[write(tmp_path / "calc.py", CALC)])
    assert registry.names() == ["add", "multiply", "divide"]
    add = registry.get("add").schema["function"]
    assert add["description"] == "Add two numbers."
    assert add["parameters"] == {
        "type": "object", "required": ["a", "b"],
        "properties": {"a": {"type": "number", "description": "First number"},
                       "b": {"type": "number", "description": "Second number"}}}
    assert registry.get("multiply").schema["function"]["parameters"]["required"] == ["a"]
    runner = ToolRunner(workers=2, timeout_s=10)
    try:
        async def calls() -> list[object]:
            return [await runner.call(registry, "add", {"a": 5, "b": 3}),
                    await runner.call(registry, "multiply", {"a": 8, "b": 2}),
                    await runner.call(registry, "divide", {"a": 1, "b": 0}),
                    await runner.call(registry, "subtract", {"a": 1, "b": 0})]
        added, multiplied, divided, unknown = asyncio.run(calls())
    finally:
        runner.close()
    assert (added.output, added.is_error) == ("8", False)
    assert multiplied.output == "16"
    assert divided.is_error and divided.error_type == "ZeroDivisionError"
    assert unknown.is_error and unknown.error_type == "ToolNotFoundError"
    # called synchronously too (an async function runs on its own loop)
    assert registry.call("add", {"a": 1, "b": 2}).output == "3"


def test_a_tools_list_chooses_the_tools(tmp_path: Path) -> None:
    spec = write(tmp_path / "listed.py", CALC + "\nTOOLS = [add]\n")
    assert [t.name for t in module_tools(spec)] == ["add"]
    spec = write(tmp_path / "bad_list.py", "TOOLS = [3]\n")
    with pytest.raises(ValueError, match="bad_list.py.*neither a function nor a tool"):
        module_tools(spec)
    spec = write(tmp_path / "empty.py", "import os\n")
    with pytest.raises(ValueError, match="empty.py.* holds no tool"):
        module_tools(spec)


def test_a_module_that_cannot_be_imported_and_a_clash_are_refused_naming_them(
        tmp_path: Path) -> None:
    broken = write(tmp_path / "broken.py", "import no_such_package_here\n")
    with pytest.raises(ValueError, match=r"tool module '.*broken.py' cannot be imported: "
                                         r"ModuleNotFoundError"):
        build_registry(modules=[broken])
    with pytest.raises(ValueError, match="tool module 'no_such.module' cannot be imported"):
        build_registry(modules=["no_such.module"])
    first = write(tmp_path / "one.py", CALC)
    second = write(tmp_path / "two.py", "def add(x: int) -> int:\n    return x\n")
    with pytest.raises(ValueError, match=r"tool name clash: 'add' is given by tool module "
                                         r"'.*one.py' and by tool module '.*two.py'"):
        build_registry(modules=[first, second])


@pytest.mark.parametrize("sse", [False, True])
def test_an_mcp_server_lists_and_calls_its_tools(sse: bool) -> None:
    number = {"type": "number"}
    schema = {"type": "object", "properties": {"a": number, "b": number},
              "required": ["a", "b"]}

    def fail(a: float, b: float) -> float:
        raise RuntimeError("no such thing")

    with McpServer({"add": ("Add two numbers", schema, lambda a, b: a + b),
                    "fail": ("Always fails", schema, fail)}, sse=sse) as mcp:
        registry = build_registry(mcp_servers=[mcp.url])
        assert registry.names() == ["add", "fail"]
        assert registry.get("add").schema["function"]["parameters"] == schema
        assert registry.call("add", {"a": 2, "b": 3}).output == "5"
        failed = registry.call("fail", {"a": 1, "b": 1})
        assert failed.is_error and failed.error_type == "MCPToolError"
        assert failed.output == "no such thing"
        gone = MCPServer(mcp.url).call("nothing", {})
        assert gone.is_error and "unknown tool nothing" in gone.output
        assert mcp.methods[0] == "initialize" and "notifications/initialized" in mcp.methods
        assert mcp.calls[:2] == [("add", {"a": 2, "b": 3}), ("fail", {"a": 1, "b": 1})]
        with McpServer({"add": ("Add", schema, lambda a, b: a + b)}) as other, \
                pytest.raises(ValueError, match="tool name clash: 'add' is given by MCP server"):
            build_registry(mcp_servers=[mcp.url, other.url])
    with pytest.raises(ValueError, match="MCP server .* cannot be reached"):
        build_registry(mcp_servers=[mcp.url])


def test_the_servers_tools_come_first_then_the_runs_and_the_requests(tmp_path: Path) -> None:
    from store.settings import Settings
    from workers.rollout.user_tools import offered_tools

    assert offered_tools(Settings(data_dir=tmp_path)).names() == ["calculator"]
    calc = write(tmp_path / "calc.py", CALC + "\nTOOLS = [add, multiply]\n")
    extra = write(tmp_path / "extra.py", "def negate(x: int) -> int:\n    return -x\n")
    settings = Settings(data_dir=tmp_path, rollout_tool_modules=f" {calc} ,")
    schema = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
    with McpServer({"search": ("Search", schema, lambda q: q.upper())}) as mcp:
        registry = offered_tools(settings, modules=[extra], tool_server_url=mcp.url)
        assert registry.names() == ["add", "multiply", "negate", "search"]
        assert registry.call("search", {"q": "x"}).output == "X"
    # the same module named twice is one source; another module's add is a clash
    assert offered_tools(settings, modules=[calc]).names() == ["add", "multiply"]
    other = write(tmp_path / "other.py", "def add(x: int) -> int:\n    return x\n")
    with pytest.raises(ValueError, match="tool name clash: 'add'"):
        offered_tools(settings, modules=[other])
