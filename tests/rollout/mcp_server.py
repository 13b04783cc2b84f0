"""A small MCP server for the tests, written from the protocol's JSON-RPC 2.0 messages
(``initialize``, ``notifications/initialized``, ``tools/list``, ``tools/call``) over HTTP: a
FastAPI app under uvicorn in a thread. Its tools are the callables given to it; each call is
kept in ``calls``. ``sse`` answers with one server-sent event instead of JSON."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tests.servers import ThreadedServer

__all__ = ["McpServer"]


class McpServer:
    def __init__(self, tools: dict[str, tuple[str, dict[str, Any], Callable[..., Any]]], *,
                 sse: bool = False) -> None:
        self.tools = tools
        self.sse = sse
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.methods: list[str] = []
        app = FastAPI()

        @app.post("/mcp")
        async def rpc(request: Request) -> Response:
            body = await request.json()
            method = body.get("method")
            self.methods.append(method)
            if "id" not in body:  # a notification
                return Response(status_code=202)
            result: Any
            if method == "initialize":
                result = {"protocolVersion": "2025-03-26", "capabilities": {"tools": {}},
                          "serverInfo": {"name": "test-mcp", "version": "0"}}
            elif method == "tools/list":
                result = {"tools": [{"name": name, "description": description,
                                     "inputSchema": schema}
                                    for name, (description, schema, _) in self.tools.items()]}
            elif method == "tools/call":
                name = body["params"]["name"]
                arguments = body["params"].get("arguments") or {}
                self.calls.append((name, arguments))
                if name not in self.tools:
                    return self._answer(body["id"], error={"code": -32602,
                                                           "message": f"unknown tool {name}"})
                try:
                    value = self.tools[name][2](**arguments)
                    result = {"content": [{"type": "text", "text": str(value)}],
                              "isError": False}
                except Exception as exc:
                    result = {"content": [{"type": "text", "text": str(exc)}], "isError": True}
            else:
                return self._answer(body["id"], error={"code": -32601,
                                                       "message": f"no method {method}"})
            return self._answer(body["id"], result=result)

        self.server = ThreadedServer(app, lifespan="off")

    def _answer(self, ident: Any, *, result: Any = None, error: Any = None) -> Response:
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": ident}
        if error is not None:
            message["error"] = error
        else:
            message["result"] = result
        if self.sse:
            return Response(f"event: message\ndata: {json.dumps(message)}\n\n",
                            media_type="text/event-stream",
                            headers={"Mcp-Session-Id": "s-1"})
        return JSONResponse(message, headers={"Mcp-Session-Id": "s-1"})

    @property
    def url(self) -> str:
        return f"{self.server.url}/mcp"

    def __enter__(self) -> McpServer:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()
