"""The user's own tools for remote rollouts: a Python module of tool functions, an MCP server.

**A module of tool functions.** A module is named by its dotted import name
(``mypackage.tools``) or by the path of a ``.py`` file. Its tools are the callables of its
``TOOLS`` list when it has one; otherwise every public function defined in the module itself
(not imported into it, not starting with ``_``). Each function becomes a tool with an
OpenAI function schema made from its signature and docstring:

- the tool's name is the function's name, its description the docstring's first paragraph;
- each parameter is a property typed from its annotation (``int`` ``integer``, ``float``
  ``number``, ``str`` ``string``, ``bool`` ``boolean``, ``list``/``tuple`` ``array``,
  ``dict`` ``object``; anything else untyped), described by its line in the docstring's
  ``Args:`` section; parameters without a default are required;
- a function may be ``async``; its result becomes the text the model sees as the
  reference RolloutServer writes it (a number or a string as ``str``, anything else as
  JSON), and an exception it raises is an error outcome named by its type.

An entry of ``TOOLS`` that is already a :class:`~workers.rollout.tools.Tool` (a ``name``, a
``schema`` and ``__call__``) is taken as it is.

**An MCP server.** :class:`MCPServer` speaks the two JSON-RPC 2.0 calls a client of the Model
Context Protocol needs over HTTP (a ``POST`` of one request, answered with JSON or with one
server-sent event): ``tools/list`` (each tool's ``name``, ``description`` and
``inputSchema``) and ``tools/call`` (``content`` text parts joined; ``isError`` an error
outcome). It sends ``initialize`` first and keeps the ``Mcp-Session-Id`` it is given.

:func:`build_registry` joins the sources into one :class:`~workers.rollout.tools.ToolRegistry`:
a tool name given twice is refused (ValueError naming both sources), so is a module that
cannot be imported or holds no tool, and a server that cannot be listed. Nothing here runs
the agent loop: the API lists and checks tools with it.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import json
import re
import sys
import threading
import typing
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from workers.rollout.tools import Tool, ToolOutcome, ToolRegistry, function_schema

__all__ = [
    "FunctionTool",
    "MCPServer",
    "MCPTool",
    "build_registry",
    "load_tool_module",
    "module_tools",
    "offered_tools",
    "split_setting",
]

_JSON_TYPES: dict[Any, str] = {int: "integer", float: "number", str: "string", bool: "boolean",
                               list: "array", tuple: "array", dict: "object"}
_lock = threading.Lock()
_modules: dict[str, Any] = {}


def split_setting(value: str | None) -> list[str]:
    """The entries of a comma-separated setting, blanks dropped."""
    return [part.strip() for part in (value or "").split(",") if part.strip()]


def _render(result: Any) -> str:
    if isinstance(result, bool):
        return json.dumps(result)
    if isinstance(result, int | float | str):
        return str(result)
    return json.dumps(result, default=str)


def _docstring_parts(doc: str | None) -> tuple[str, dict[str, str]]:
    """The first paragraph of ``doc`` and the descriptions of its ``Args:`` lines."""
    text = inspect.cleandoc(doc or "")
    summary = text.split("\n\n", 1)[0].replace("\n", " ").strip()
    args: dict[str, str] = {}
    section = re.search(r"^(?:Args|Arguments|Parameters):\s*\n((?:[ \t]+.*\n?)+)", text,
                        flags=re.MULTILINE)
    if section:
        for line in section.group(1).splitlines():
            found = re.match(r"\s+(\w+)(?:\s*\([^)]*\))?\s*:\s*(.*)", line)
            if found:
                args[found.group(1)] = found.group(2).strip()
    return summary, args


def _json_type(annotation: Any) -> str | None:
    origin = typing.get_origin(annotation) or annotation
    return _JSON_TYPES.get(origin)


class FunctionTool:
    """A Python function as a tool (module docstring)."""

    idempotent = False

    def __init__(self, function: Callable[..., Any], *, source: str = "") -> None:
        if not callable(function):
            raise TypeError(f"a tool must be callable, got {type(function).__name__}")
        self.function = function
        self.name = str(getattr(function, "__name__", ""))
        self.source = source
        self.is_async = inspect.iscoroutinefunction(function)
        if self.is_async:  # awaited on the loop; a plain function runs on the tool pool
            self.acall = self._acall
        summary, described = _docstring_parts(function.__doc__)
        try:
            hints = typing.get_type_hints(function)
        except Exception:  # an annotation that does not resolve is left untyped
            hints = {}
        properties: dict[str, Any] = {}
        required: list[str] = []
        for parameter in inspect.signature(function).parameters.values():
            if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
                continue
            spec: dict[str, Any] = {}
            kind = _json_type(hints.get(parameter.name))
            if kind is not None:
                spec["type"] = kind
            if parameter.name in described:
                spec["description"] = described[parameter.name]
            properties[parameter.name] = spec
            if parameter.default is parameter.empty:
                required.append(parameter.name)
        self.schema = function_schema(self.name, description=summary or self.name,
                                      properties=properties, required=required)

    def _outcome(self, run: Callable[[], Any]) -> ToolOutcome:
        try:
            return ToolOutcome(output=_render(run()))
        except Exception as exc:
            return ToolOutcome.error(type(exc).__name__, str(exc))

    def __call__(self, arguments: dict[str, Any]) -> ToolOutcome:
        if self.is_async:
            return self._outcome(lambda: asyncio.run(self.function(**arguments)))
        return self._outcome(lambda: self.function(**arguments))

    async def _acall(self, arguments: dict[str, Any]) -> ToolOutcome:
        """Await an ``async`` function on the caller's loop."""
        try:
            return ToolOutcome(output=_render(await self.function(**arguments)))
        except Exception as exc:
            return ToolOutcome.error(type(exc).__name__, str(exc))


def load_tool_module(spec: str) -> Any:
    """Import the tool module ``spec`` (a dotted name, or the path of a ``.py`` file), once
    per process. ValueError naming ``spec`` when it cannot be imported."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"tool module must be a non-empty string, got {spec!r}")
    with _lock:
        if spec in _modules:
            return _modules[spec]
        try:
            if spec.endswith(".py") or "/" in spec:
                path = Path(spec)
                if not path.is_file():
                    raise FileNotFoundError(f"no such file {spec}")
                name = "trajstore_user_tools_" + hashlib.sha1(
                    str(path.resolve()).encode()).hexdigest()[:12]
                loader_spec = importlib.util.spec_from_file_location(name, path)
                if loader_spec is None or loader_spec.loader is None:
                    raise ImportError(f"{spec} is not a Python module")
                module = importlib.util.module_from_spec(loader_spec)
                sys.modules[name] = module
                try:
                    loader_spec.loader.exec_module(module)
                except BaseException:
                    sys.modules.pop(name, None)
                    raise
            else:
                module = importlib.import_module(spec)
        except Exception as exc:
            raise ValueError(f"tool module {spec!r} cannot be imported: "
                             f"{type(exc).__name__}: {exc}") from None
        _modules[spec] = module
        return module


def module_tools(spec: str) -> list[Tool]:
    """The tools of module ``spec`` (module docstring); ValueError naming it when it cannot
    be imported, its ``TOOLS`` holds something that is not a tool, or it has no tool."""
    module = load_tool_module(spec)
    listed = getattr(module, "TOOLS", None)
    if listed is not None:
        if not isinstance(listed, Sequence) or isinstance(listed, str | bytes):
            raise ValueError(f"tool module {spec!r}: TOOLS must be a list of functions or "
                             f"tools, got {type(listed).__name__}")
        entries = list(listed)
    else:
        entries = [value for key, value in vars(module).items()
                   if not key.startswith("_") and inspect.isfunction(value)
                   and value.__module__ == module.__name__]
    tools: list[Tool] = []
    for entry in entries:
        if isinstance(entry, Tool) and not inspect.isfunction(entry):
            tools.append(entry)
        elif callable(entry):
            try:
                tools.append(FunctionTool(entry, source=spec))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"tool module {spec!r}: {exc}") from None
        else:
            raise ValueError(f"tool module {spec!r}: TOOLS holds {entry!r}, which is neither "
                             "a function nor a tool")
    if not tools:
        raise ValueError(f"tool module {spec!r} holds no tool (no TOOLS list and no public "
                         "function defined in it)")
    return tools


def _sse_or_json(text: str, content_type: str) -> Any:
    if "text/event-stream" in content_type:
        data = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
        for item in data:
            if item:
                return json.loads(item)
        raise ValueError("the event stream carried no data")
    return json.loads(text)


class MCPServer:
    """A client of one MCP server at ``url`` (module docstring); ``timeout_s`` per request."""

    def __init__(self, url: str, *, timeout_s: float = 30.0, source: str | None = None) -> None:
        if not isinstance(url, str) or not re.match(r"^https?://[^/\s]+", url):
            raise ValueError(f"MCP server {url!r} must be an http(s) URL")
        self.url = url
        self.timeout_s = timeout_s
        self.source = source or f"MCP server {url}"
        self._session: str | None = None
        self._initialized = False
        self._ids = 0
        self._lock = threading.Lock()

    def _post(self, method: str, params: dict[str, Any] | None, *, notify: bool = False
              ) -> Any:
        import httpx

        with self._lock:
            self._ids += 1
            ident = self._ids
        body: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            body["params"] = params
        if not notify:
            body["id"] = ident
        headers = {"Accept": "application/json, text/event-stream"}
        if self._session:
            headers["Mcp-Session-Id"] = self._session
        answer = httpx.post(self.url, json=body, headers=headers, timeout=self.timeout_s,
                            follow_redirects=False)
        session = answer.headers.get("mcp-session-id")
        if session:
            self._session = session
        if notify:
            return None
        if answer.status_code >= 400:
            raise ValueError(f"{self.source} answered {method} with HTTP {answer.status_code}")
        try:
            data = _sse_or_json(answer.text, answer.headers.get("content-type", ""))
        except ValueError as exc:
            raise ValueError(f"{self.source} answered {method} with something that is not "
                             f"JSON-RPC: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{self.source} answered {method} with {type(data).__name__}")
        if data.get("error") is not None:
            error = data["error"]
            message = error.get("message") if isinstance(error, dict) else error
            raise ValueError(f"{self.source} refused {method}: {message}")
        return data.get("result")

    def _initialize(self) -> None:
        if self._initialized:
            return
        try:
            self._post("initialize", {"protocolVersion": "2025-03-26", "capabilities": {},
                                      "clientInfo": {"name": "trajstore", "version": "1"}})
            self._post("notifications/initialized", None, notify=True)
        except ValueError as exc:
            if "initialize" not in str(exc) or "HTTP" in str(exc):
                raise
            # a server that knows no initialize still lists and calls tools
        self._initialized = True

    def list_tools(self) -> list[MCPTool]:
        """The server's tools (every page of ``tools/list``). ValueError naming the server
        when it cannot be reached or answers out of the protocol."""
        import httpx

        tools: list[MCPTool] = []
        cursor: str | None = None
        try:
            self._initialize()
            for _ in range(100):
                result = self._post("tools/list", {"cursor": cursor} if cursor else {})
                if not isinstance(result, dict) or not isinstance(result.get("tools"), list):
                    raise ValueError(f"{self.source}: tools/list result has no 'tools' list")
                for item in result["tools"]:
                    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                        raise ValueError(f"{self.source}: tools/list holds {item!r}, not a "
                                         "tool with a name")
                    tools.append(MCPTool(self, item))
                cursor = result.get("nextCursor")
                if not cursor:
                    break
        except httpx.HTTPError as exc:
            raise ValueError(f"{self.source} cannot be reached: {type(exc).__name__}: "
                             f"{exc}") from None
        return tools

    def call(self, name: str, arguments: dict[str, Any]) -> ToolOutcome:
        """``tools/call``: the text parts of its ``content`` joined; ``isError`` an error
        outcome (``MCPToolError``); a failure to reach the server ``MCPError``."""
        import httpx

        try:
            self._initialize()
            result = self._post("tools/call", {"name": name, "arguments": arguments})
        except (httpx.HTTPError, ValueError) as exc:
            return ToolOutcome.error("MCPError", str(exc))
        if not isinstance(result, dict):
            return ToolOutcome.error("MCPError", f"{self.source}: tools/call result is "
                                                 f"{type(result).__name__}")
        parts = result.get("content") or []
        texts = [str(p.get("text", "")) for p in parts
                 if isinstance(p, dict) and p.get("type") == "text"]
        if not texts and result.get("structuredContent") is not None:
            texts = [json.dumps(result["structuredContent"])]
        output = "\n".join(texts)
        if result.get("isError"):
            return ToolOutcome.error("MCPToolError", output or f"{name} failed", output=output)
        return ToolOutcome(output=output)


class MCPTool:
    """One tool of an :class:`MCPServer`."""

    idempotent = False

    def __init__(self, server: MCPServer, listed: dict[str, Any]) -> None:
        self.server = server
        self.name = str(listed["name"])
        self.source = server.source
        parameters = listed.get("inputSchema")
        if not isinstance(parameters, dict):
            parameters = {"type": "object", "properties": {}}
        self.schema = {"type": "function",
                       "function": {"name": self.name,
                                    "description": str(listed.get("description") or self.name),
                                    "parameters": parameters}}

    def __call__(self, arguments: dict[str, Any]) -> ToolOutcome:
        return self.server.call(self.name, arguments)


def build_registry(*, modules: Iterable[str] = (), mcp_servers: Iterable[str] = (),
                   timeout_s: float = 30.0) -> ToolRegistry:
    """One registry of the tools of ``modules`` and ``mcp_servers`` (module docstring).
    ValueError naming the source for a module that cannot be imported, a server that cannot
    be listed, and a tool name that two sources give."""
    registry = ToolRegistry()
    origin: dict[str, str] = {}
    sources: list[tuple[str, list[Any]]] = []
    for spec in modules:
        sources.append((f"tool module {spec!r}", module_tools(spec)))
    for url in mcp_servers:
        server = MCPServer(url, timeout_s=timeout_s)
        sources.append((server.source, server.list_tools()))
    for source, tools in sources:
        for tool in tools:
            if tool.name in origin:
                raise ValueError(f"tool name clash: {tool.name!r} is given by {origin[tool.name]}"
                                 f" and by {source}")
            try:
                registry.register(tool)
            except ValueError as exc:
                raise ValueError(f"{source}: {exc}") from None
            origin[tool.name] = source
    return registry


def offered_tools(settings: Any, *, modules: Iterable[str] = (),
                  mcp_servers: Iterable[str] = (), tool_server_url: str | None = None,
                  timeout_s: float = 30.0) -> ToolRegistry:
    """The tools a remote rollout offers: the server's (``settings.rollout_tool_modules``,
    ``settings.rollout_mcp_servers``), the run's (``modules``, ``mcp_servers``) and the
    request's ``tool_server_url`` (an MCP server), in that order; the calculator alone when
    none is given. Errors as :func:`build_registry`."""
    from workers.rollout.calculator import Calculator

    all_modules = [*split_setting(getattr(settings, "rollout_tool_modules", "")), *modules]
    servers = [*split_setting(getattr(settings, "rollout_mcp_servers", "")), *mcp_servers]
    if tool_server_url:
        servers.append(tool_server_url)
    if not all_modules and not servers:
        return ToolRegistry([Calculator()])
    return build_registry(modules=dict.fromkeys(all_modules), mcp_servers=dict.fromkeys(servers),
                          timeout_s=timeout_s)
