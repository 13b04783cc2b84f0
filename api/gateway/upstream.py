"""The upstream server: an OpenAI-compatible vLLM server the gateway forwards calls to.

Each forwarded request asks the server for what the gateway records: ``return_token_ids``
(vLLM's prompt and generated token ids) and the sampled tokens' logprobs. What the caller
did not ask for is taken out of the answer again (``openai_format.strip_extensions``), so
the caller gets the answer it would have got from the server directly.
"""

from __future__ import annotations

from typing import Any

import httpx

from api.errors import ApiError
from store.settings import Settings

__all__ = ["Upstream"]


class Upstream:
    """An async client of ``gateway_upstream_url`` (created inside the serving event loop)."""

    def __init__(self, settings: Settings) -> None:
        if not settings.gateway_upstream_url:
            raise ValueError("gateway_upstream_url is not set")
        url = settings.gateway_upstream_url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"gateway_upstream_url must be an http(s) URL, got {url!r}")
        headers = {}
        if settings.gateway_upstream_api_key:
            headers["Authorization"] = f"Bearer {settings.gateway_upstream_api_key}"
        self.base_url = url + "/v1"
        self.model = settings.gateway_upstream_model
        self.client = httpx.AsyncClient(base_url=self.base_url, headers=headers,
                                        timeout=settings.gateway_timeout_s)

    def prepare(self, body: dict[str, Any], *, chat: bool) -> dict[str, Any]:
        """The body sent upstream: the caller's, asking for token ids and logprobs."""
        out = dict(body)
        out["return_token_ids"] = True
        if chat:
            out["logprobs"] = True
            if out.get("top_logprobs") is None:
                out.pop("top_logprobs", None)
        elif not isinstance(out.get("logprobs"), int) or isinstance(out.get("logprobs"), bool):
            out["logprobs"] = 0
        if self.model:
            out["model"] = self.model
        return out

    async def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        """POST ``body`` to ``/v1<path>``. ApiError 502 when the server cannot be reached,
        504 when it does not answer in time."""
        return await self._send(path, body, stream=False)

    async def open_stream(self, path: str, body: dict[str, Any]) -> httpx.Response:
        """A streamed POST: the response with its body still to read (the caller closes it
        with ``aclose``). Same errors as ``post`` while connecting."""
        return await self._send(path, body, stream=True)

    async def _send(self, path: str, body: dict[str, Any], *, stream: bool) -> httpx.Response:
        try:
            request = self.client.build_request("POST", path, json=body)
            return await self.client.send(request, stream=stream)
        except httpx.TimeoutException:
            raise ApiError(504, "upstream_timeout", f"the upstream server did not answer "
                           f"{path} in time") from None
        except httpx.HTTPError as exc:
            raise ApiError(502, "upstream_unreachable",
                           f"the upstream server failed on {path}: {exc}") from None

    async def aclose(self) -> None:
        await self.client.aclose()
