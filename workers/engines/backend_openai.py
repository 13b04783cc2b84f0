"""Generation through an OpenAI-compatible vLLM server, with token ids returned.

Requests with ``messages`` go to ``/v1/chat/completions``; requests with ``prompt_ids`` go to
``/v1/completions`` with the ids as the prompt. Both ask for ``return_token_ids: true`` and the
sampled tokens' logprobs, and read:

- completion ids from ``choices[0].token_ids``;
- prompt ids from the top-level ``prompt_token_ids`` (chat) or ``choices[0].prompt_token_ids``
  (completions);
- logprobs from ``choices[0].logprobs.content[i].logprob`` (chat) or
  ``choices[0].logprobs.token_logprobs`` (completions).

Tool calls are parsed by this package from the raw text (:mod:`workers.engines.toolcall`), so
chat requests send the tool schemas with ``tool_choice: "none"``: the server renders them into
the prompt but does not need a tool parser. For logprobs under the sampling distribution
(:mod:`workers.engines.backend`) start the server with ``--logprobs-mode processed_logprobs``;
with vLLM's default (``raw_logprobs``) the logprobs are those of the unscaled model
distribution.

Weight updates: :meth:`OpenAIServerBackend.update_weights_from` asks a vLLM server to reload its
weights in place from a checkpoint folder the *server* can read (shared storage), through
vLLM's development routes (``POST /collective_rpc`` with ``reload_weights``, then ``POST
/reset_prefix_cache``; start the server with ``VLLM_SERVER_DEV_MODE=1``). Wrapped in a
:class:`~workers.rollout.worker_engine.RolloutEngine`, the server then reports the version it took
like any engine (``policy_served``, engine id: the server's address). Tensors cannot be pushed
to it (:meth:`OpenAIServerBackend.update_weights` refuses).

The same client serves the remote-rollout protocol's trainer endpoint, which speaks
``/v1/completions`` with token ids.
"""

from __future__ import annotations

import asyncio
import os
import weakref
from typing import Any

import numpy as np

from store.arguments import whole_number
from workers.engines.backend import GenerationRequest, GenerationResult

__all__ = ["OpenAIServerBackend", "ServerResponseError"]


class ServerResponseError(RuntimeError):
    """The server answered with an error status or without the fields this client needs."""


class OpenAIServerBackend:
    """Client of an OpenAI-compatible server (module docstring).

    ``base_url`` like ``http://127.0.0.1:8000`` (``/v1`` is appended); ``model`` the served
    model name; ``timeout_s`` per request. Raises ValueError for an empty URL or model name.
    ``generate`` raises :class:`ServerResponseError` for HTTP errors and incomplete answers.
    """

    def __init__(self, base_url: str, *, model: str, timeout_s: float = 120.0,
                 api_key: str | None = None, policy_version: int = 0,
                 max_connections: int = 64) -> None:
        import httpx

        whole_number("max_connections", max_connections)

        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        if not isinstance(model, str) or not model:
            raise ValueError(f"model must be a non-empty string, got {model!r}")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model
        self.policy_version = policy_version
        #: The server's address: its id in ``policy_served`` reports.
        self.engine_id = base_url.rstrip("/")
        self.client = httpx.Client(base_url=base_url.rstrip("/") + "/v1", timeout=timeout_s,
                                   headers=headers)
        self._async_settings: dict[str, Any] = {
            "base_url": base_url.rstrip("/") + "/v1", "timeout": timeout_s, "headers": headers,
            "limits": httpx.Limits(max_connections=max_connections,
                                   max_keepalive_connections=max_connections)}
        self._async_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = (
            weakref.WeakKeyDictionary())

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self.client.close()

    def update_weights_from(self, folder: str | os.PathLike[str], *, version: int) -> None:
        """Have the server reload its weights in place from the safetensors files of
        ``folder`` (a path on the server's side), reset its prefix cache and set
        ``policy_version`` (module docstring). Call it with no request in flight. Raises
        TypeError for a non-integer ``version``, ValueError for a negative one, and
        :class:`ServerResponseError` when the server refuses (a 404 means it runs without
        ``VLLM_SERVER_DEV_MODE=1``); ``policy_version`` is then unchanged."""
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"version must be an integer, got {version!r}")
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        calls = (("/collective_rpc", {"method": "reload_weights",
                                      "kwargs": {"weights_path": os.fspath(folder)}}),
                 ("/reset_prefix_cache", None))
        for path, body in calls:
            response = self.client.post(self.engine_id + path, json=body)
            if response.status_code >= 400:
                hint = (" (is the server started with VLLM_SERVER_DEV_MODE=1?)"
                        if response.status_code == 404 else "")
                raise ServerResponseError(f"POST {path} returned {response.status_code}"
                                          f"{hint}: {response.text[:500]}")
        self.policy_version = version

    def update_weights(self, weights: Any, *, version: int) -> None:
        """Refused: a server on another machine cannot read this process's tensors. Save them
        where the server can read them and call :meth:`update_weights_from`. Raises
        TypeError."""
        raise TypeError("an OpenAI-compatible server takes weights from a folder it can read: "
                        "save a checkpoint on shared storage and call update_weights_from")

    def request_body(self, request: GenerationRequest) -> dict[str, Any]:
        """The JSON body sent for ``request`` (chat or completions, module docstring)."""
        params = request.sampling
        body: dict[str, Any] = {
            "model": self.model,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_tokens": params.max_tokens,
            "logprobs": True if request.messages is not None else 0,
            "return_token_ids": True,
            "skip_special_tokens": True,
        }
        if params.seed is not None:
            body["seed"] = params.seed
        if params.stop:
            body["stop"] = list(params.stop)
        if request.messages is not None:
            body["messages"] = [dict(m) for m in request.messages]
            body["top_logprobs"] = 0
            if request.tools:
                body["tools"] = [dict(t) for t in request.tools]
                body["tool_choice"] = "none"
        else:
            body["prompt"] = list(request.prompt_ids or ())
        return body

    def generate(self, request: GenerationRequest) -> GenerationResult:
        """Send one request and convert the answer (module docstring)."""
        if not isinstance(request, GenerationRequest):
            raise TypeError(f"request must be a GenerationRequest, got {type(request).__name__}")
        path = "/chat/completions" if request.messages is not None else "/completions"
        return self._result(path, self.client.post(path, json=self.request_body(request)))

    async def agenerate(self, request: GenerationRequest) -> GenerationResult:
        """Send one request without blocking the event loop; concurrent requests share a
        pool of at most ``max_connections`` connections (one pool per event loop), and the
        server batches them. Errors as :meth:`generate`."""
        import httpx

        if not isinstance(request, GenerationRequest):
            raise TypeError(f"request must be a GenerationRequest, got {type(request).__name__}")
        loop = asyncio.get_running_loop()
        client = self._async_clients.get(loop)
        if client is None:
            client = self._async_clients[loop] = httpx.AsyncClient(**self._async_settings)
        path = "/chat/completions" if request.messages is not None else "/completions"
        response = await client.post(path, json=self.request_body(request))
        return self._result(path, response)

    def _result(self, path: str, response: Any) -> GenerationResult:
        chat = path == "/chat/completions"
        if response.status_code >= 400:
            raise ServerResponseError(f"POST {path} returned {response.status_code}: "
                                      f"{response.text[:500]}")
        data = response.json()
        try:
            choice = data["choices"][0]
            token_ids = choice["token_ids"]
            if chat:
                prompt_ids = data["prompt_token_ids"]
                logprobs = [item["logprob"] for item in choice["logprobs"]["content"]]
                text = choice["message"].get("content") or ""
            else:
                prompt_ids = choice["prompt_token_ids"]
                logprobs = choice["logprobs"]["token_logprobs"]
                text = choice.get("text") or ""
            finish = choice["finish_reason"]
        except (KeyError, IndexError, TypeError) as exc:
            raise ServerResponseError(f"POST {path} answer lacks {exc}; is the server a vLLM "
                                      f"version that supports return_token_ids?") from None
        if token_ids is None or prompt_ids is None:
            raise ServerResponseError(f"POST {path} answer has no token ids")
        return GenerationResult(
            prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
            response_ids=np.asarray(token_ids, dtype=np.int32),
            logprobs=np.asarray(logprobs, dtype=np.float32),
            text=text,
            finish_reason="length" if finish == "length" else "stop",
            policy_version=self.policy_version,
        )
