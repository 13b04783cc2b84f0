"""The request size limit: a body over ``api_max_request_bytes`` is answered 413 before
any route sees it (a declared ``Content-Length`` over the limit is refused unread; a chunked
body is counted as it arrives and refused as soon as it passes the limit). And the URL check:
a NUL character in the path or in a query parameter is answered 422 naming it, before any
route passes it to the database (whose text cannot hold NUL)."""

from __future__ import annotations

import json
import urllib.parse
from typing import Any

__all__ = ["BodyLimit", "NoNulInUrl"]

_METHODS = {"POST", "PUT", "PATCH"}


class BodyLimit:
    """ASGI middleware enforcing ``max_bytes`` on request bodies."""

    def __init__(self, app: Any, *, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def _too_large(self, send: Any, size: int | None) -> None:
        seen = f"{size} bytes" if size is not None else "more"
        body = json.dumps({"error": {
            "code": "payload_too_large",
            "message": f"the request body holds {seen}, over the limit of {self.max_bytes} "
                       "bytes; send smaller batches",
            "limit": self.max_bytes}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") not in _METHODS:
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = None
                if declared is not None and declared > self.max_bytes:
                    await self._too_large(send, declared)
                    return
        # Read the body here, counting, so that a chunked upload over the limit is refused
        # without a route ever buffering it; then hand the body on as one message.
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(send, None)
                return
            parts.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(parts), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class NoNulInUrl:
    """ASGI middleware answering 422 to a request whose path or query string decodes to
    text holding NUL (``%00``), naming the query parameter (or ``path``)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            where = _nul_in_url(scope)
            if where is not None:
                body = json.dumps({"error": {
                    "code": "invalid_request",
                    "message": f"{where}: must not contain a NUL character (%00)",
                    "field": where}}).encode()
                await send({"type": "http.response.start", "status": 422,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def _nul_in_url(scope: Any) -> str | None:
    if "\x00" in scope.get("path", ""):
        return "path"
    query = scope.get("query_string", b"")
    if b"%00" not in query and b"\x00" not in query:
        return None
    for name, value in urllib.parse.parse_qsl(query.decode("latin-1"), keep_blank_values=True,
                                              encoding="utf-8", errors="replace"):
        if "\x00" in value or "\x00" in name:
            return name.replace("\x00", "\\x00")[:100] or "query"
    return None
