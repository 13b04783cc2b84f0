"""Generation at a remote trainer's completions endpoint (the RolloutServer side of the
remote-rollout protocol).

In the remote-rollout protocol the trainer owns the inference engine and this process drives
the agent loop. Each LLM call is one ``POST {server_url}/v1/completions`` (or
``/v1/chat/completions``) carrying the *full* conversation:

.. code-block:: json

    {"model": "default", "rollout_id": "…", "messages": […], "tools": […],
     "response_mask": null, "temperature": 1.0, "top_p": 1.0, "max_tokens": 256,
     "logprobs": true}

``response_mask`` follows the protocol's RolloutSession exactly. The trainer keeps one
append-only token buffer per rollout; the mask tells it how many of the prompt tokens that are
new since its last generation are *not* the model's own (tool outputs, feedback, the chat
template's turn markers): they get mask 0.

- the first call sends ``null``;
- every later call renders the messages with the rollout's tokenizer
  (``apply_chat_template(messages, tools, add_generation_prompt=True)``), counts
  ``new = len(prompt) - last_prompt_length`` where ``last_prompt_length`` is the previous
  call's prompt length plus the number of tokens it generated, and sends ``[0] * new``
  (``null`` when ``new`` is 0);
- a negative count (the conversation shrank or was rewritten: truncation, a rollback, a
  template that edits history) cannot be described by an append-only mask and ends the
  rollout with a ``response_mask`` error instead of sending a wrong mask.

The answer must carry the generated ``token_ids``, one ``logprobs`` value per generated token
and the ``prompt_token_ids`` the engine saw, either at the top level (the TrainGate form) or in
``choices[0]`` (vLLM's form); ``logprobs`` may be a list of numbers or OpenAI's
``{"content": [{"logprob": …}]}`` / ``{"token_logprobs": […]}`` objects. The generated text is
decoded here from ``token_ids`` with the rollout's tokenizer, so tool calls are parsed from the
exact tokens the engine produced.

Trainer failures raise :class:`RemoteTrainerError` with a category:

==================  ===========================================================
``rate_limited``    HTTP 429
``server_error``    HTTP 5xx
``client_error``    any other HTTP 4xx (401/403: the callback key was refused)
``network``         connection refused or reset, DNS failure, timeout
``malformed``       not JSON, fields missing or of the wrong type, lengths disagree
``response_mask``   the conversation shrank since the previous call (see above)
==================  ===========================================================
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from workers.rollout.backend import FinishReason, GenerationRequest, GenerationResult
from workers.rollout.prompt import decode_response, end_of_turn_ids, render_prompt_ids

__all__ = [
    "TRAINER_ERROR_CATEGORIES",
    "RemoteTrainerBackend",
    "RemoteTrainerError",
    "session_response_mask",
]

TRAINER_ERROR_CATEGORIES = ("rate_limited", "server_error", "client_error", "network",
                            "malformed", "response_mask")

_ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class RemoteTrainerError(RuntimeError):
    """The trainer's endpoint failed; ``category`` is one of
    :data:`TRAINER_ERROR_CATEGORIES`, ``status_code`` the HTTP status when there was one."""

    def __init__(self, category: str, message: str, *, status_code: int | None = None) -> None:
        if category not in TRAINER_ERROR_CATEGORIES:
            raise ValueError(f"category must be one of {TRAINER_ERROR_CATEGORIES}, "
                             f"got {category!r}")
        super().__init__(message)
        self.category = category
        self.status_code = status_code


def session_response_mask(*, prompt_length: int, last_prompt_length: int) -> list[int] | None:
    """The protocol's ``response_mask`` for a prompt of ``prompt_length`` tokens after a
    previous call whose prompt plus generation held ``last_prompt_length`` tokens
    (0: this is the first call).

    Returns None on the first call and when no token was added, else ``[0] * added``.
    Raises :class:`RemoteTrainerError` (category ``response_mask``) when the prompt is shorter
    than ``last_prompt_length``, and ValueError for negative lengths.
    """
    for name, value in (("prompt_length", prompt_length),
                        ("last_prompt_length", last_prompt_length)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if last_prompt_length == 0:
        return None
    added = prompt_length - last_prompt_length
    if added < 0:
        raise RemoteTrainerError(
            "response_mask",
            f"the prompt has {prompt_length} tokens, fewer than the {last_prompt_length} of "
            f"the previous prompt plus its generation: the conversation was shortened or "
            f"rewritten, which an append-only response_mask cannot describe")
    return [0] * added if added > 0 else None


def _logprob_list(value: Any) -> list[float]:
    """The per-token logprobs of any of the accepted forms (module docstring)."""
    if isinstance(value, Mapping):
        if isinstance(value.get("content"), list):
            return [float(item["logprob"]) for item in value["content"]]
        if isinstance(value.get("token_logprobs"), list):
            return [float(item) for item in value["token_logprobs"]]
        raise TypeError("logprobs object has neither 'content' nor 'token_logprobs'")
    if isinstance(value, list):
        return [float(item) for item in value]
    raise TypeError(f"logprobs must be a list or an object, got {type(value).__name__}")


def _id_list(value: Any, field: str) -> list[int]:
    if not isinstance(value, list):
        raise TypeError(f"{field} must be a list of integers, got {type(value).__name__}")
    ids = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise TypeError(f"{field} must hold non-negative integers, got {item!r}")
        ids.append(item)
    return ids


class RemoteTrainerBackend:
    """A :class:`~workers.rollout.backend.GenerationBackend` whose engine is a remote
    trainer's completions endpoint, keeping the RolloutSession state of one rollout (module
    docstring). Use one instance per rollout.

    ``server_url`` the trainer's base URL (``/v1/completions`` is appended); ``rollout_id``
    sent with every call; ``tokenizer`` the rollout's tokenizer (a transformers tokenizer with
    a chat template) used to measure prompts and decode generations; ``api_key`` sent as
    ``Authorization: Bearer``; ``endpoint`` ``"completions"`` (default, the protocol's) or
    ``"chat"``; ``model`` the ``model`` field; ``extra_body`` further sampling fields sent
    verbatim (``top_k``…); ``timeout_s`` per call.

    Raises ValueError for a URL that is not http(s), an empty ``rollout_id``, an unknown
    ``endpoint``, a non-positive timeout or a tokenizer without a chat template.
    ``generate`` raises :class:`RemoteTrainerError` for every trainer failure and remembers it
    in ``error``; requests given as ``prompt_ids`` raise ValueError (the protocol sends
    messages).
    """

    def __init__(self, server_url: str, *, rollout_id: str, tokenizer: Any,
                 api_key: str | None = None, endpoint: str = "completions",
                 model: str = "default", extra_body: Mapping[str, Any] | None = None,
                 timeout_s: float = 120.0, policy_version: int = 0) -> None:
        import httpx

        if not isinstance(server_url, str) or not server_url.startswith(("http://",
                                                                         "https://")):
            raise ValueError(f"server_url must be an http(s) URL, got {server_url!r}")
        if not isinstance(rollout_id, str) or not rollout_id:
            raise ValueError(f"rollout_id must be a non-empty string, got {rollout_id!r}")
        if endpoint not in _ENDPOINTS:
            raise ValueError(f"endpoint must be one of {sorted(_ENDPOINTS)}, got {endpoint!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (
                math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number, got {timeout_s!r}")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("tokenizer must have a chat_template to measure prompts")
        if api_key is not None and not isinstance(api_key, str):
            raise TypeError(f"api_key must be a string or None, got {type(api_key).__name__}")
        self.server_url = server_url.rstrip("/")
        self.rollout_id = rollout_id
        self.tokenizer = tokenizer
        self.endpoint = endpoint
        self.path = _ENDPOINTS[endpoint]
        self.model = model
        self.extra_body = dict(extra_body or {})
        self.policy_version = policy_version
        self.stop_token_ids = end_of_turn_ids(tokenizer)
        self.last_prompt_length = 0
        self.calls = 0
        self.prompt_length_mismatches = 0
        self.error: RemoteTrainerError | None = None
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.server_url, timeout=timeout_s,
                                   headers=headers)
        self._rendered: tuple[tuple[Any, ...], list[int]] | None = None

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self.client.close()

    def __enter__(self) -> RemoteTrainerBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        """The rollout tokenizer's rendering of ``request`` (messages and tools with the
        generation prompt): what the prompt length is measured on."""
        if request.messages is None:
            raise ValueError("the remote-rollout protocol sends messages; got prompt_ids")
        key = (request.messages, request.tools)
        if self._rendered is not None and self._rendered[0] == key:
            return list(self._rendered[1])
        ids = render_prompt_ids(self.tokenizer, request)
        self._rendered = (key, ids)
        return list(ids)

    def request_body(self, request: GenerationRequest,
                     response_mask: list[int] | None) -> dict[str, Any]:
        """The JSON body of one call (module docstring)."""
        params = request.sampling
        body: dict[str, Any] = {
            **self.extra_body,
            "model": self.model,
            "rollout_id": self.rollout_id,
            "messages": [dict(m) for m in request.messages or ()],
            "response_mask": response_mask,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_tokens": params.max_tokens,
            "logprobs": True,
        }
        if request.tools:
            body["tools"] = [dict(t) for t in request.tools]
        if params.seed is not None:
            body["seed"] = params.seed
        if params.stop:
            body["stop"] = list(params.stop)
        return body

    def generate(self, request: GenerationRequest) -> GenerationResult:
        """One call to the trainer (module docstring). Raises :class:`RemoteTrainerError`."""
        if not isinstance(request, GenerationRequest):
            raise TypeError(f"request must be a GenerationRequest, got {type(request).__name__}")
        try:
            return self._generate(request)
        except RemoteTrainerError as exc:
            self.error = exc
            raise

    def _generate(self, request: GenerationRequest) -> GenerationResult:
        import httpx

        prompt = self.prompt_ids(request)
        mask = session_response_mask(prompt_length=len(prompt),
                                     last_prompt_length=self.last_prompt_length)
        try:
            response = self.client.post(self.path, json=self.request_body(request, mask))
        except httpx.TransportError as exc:  # connect, read, write, timeout, protocol
            raise RemoteTrainerError(
                "network", f"POST {self.server_url}{self.path} failed: "
                f"{type(exc).__name__}: {exc}") from None
        status = response.status_code
        if status >= 400:
            category = ("rate_limited" if status == 429 else
                        "server_error" if status >= 500 else "client_error")
            raise RemoteTrainerError(
                category, f"POST {self.path} returned HTTP {status} "
                f"({len(response.content)} bytes, not shown)", status_code=status)
        token_ids, logprobs, prompt_ids, finish = self._read_answer(response)
        self.calls += 1
        if len(prompt_ids) != len(prompt):
            self.prompt_length_mismatches += 1
        # The session's bookkeeping: the prompt as measured here plus what was generated.
        self.last_prompt_length = len(prompt) + len(token_ids)
        text, stopped_on_string = decode_response(self.tokenizer, token_ids,
                                                   stop=request.sampling.stop)
        if finish is None:
            ended = bool(token_ids) and token_ids[-1] in self.stop_token_ids
            finish = "stop" if ended or stopped_on_string else "length"
        return GenerationResult(
            prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
            response_ids=np.asarray(token_ids, dtype=np.int32),
            logprobs=np.asarray(logprobs, dtype=np.float32),
            text=text,
            finish_reason=finish,
            policy_version=self.policy_version,
        )

    def _read_answer(self, response: Any
                     ) -> tuple[list[int], list[float], list[int], FinishReason | None]:
        def malformed(problem: str) -> RemoteTrainerError:
            return RemoteTrainerError("malformed", f"POST {self.path} answer {problem}",
                                      status_code=response.status_code)

        try:
            data = response.json()
        except ValueError:
            raise malformed(f"is not JSON ({len(response.content)} bytes, not shown)") from None
        if not isinstance(data, Mapping):
            raise malformed(f"is not a JSON object but {type(data).__name__}")
        choices = data.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices else {}
        if not isinstance(choice, Mapping):
            raise malformed("has a choices[0] that is not an object")

        def field(name: str) -> Any:
            value = data.get(name)
            return choice.get(name) if value is None else value

        values = {name: field(name) for name in ("token_ids", "logprobs", "prompt_token_ids")}
        missing = [name for name, value in values.items() if value is None]
        if missing:
            raise malformed(f"lacks {missing} (neither at the top level nor in choices[0])")
        try:
            token_ids = _id_list(values["token_ids"], "token_ids")
            prompt_ids = _id_list(values["prompt_token_ids"], "prompt_token_ids")
            logprobs = _logprob_list(values["logprobs"])
        except (TypeError, KeyError, ValueError) as exc:
            raise malformed(f"has a bad field: {exc}") from None
        if len(logprobs) != len(token_ids):
            raise malformed(f"has {len(logprobs)} logprobs for {len(token_ids)} token_ids")
        if not prompt_ids:
            raise malformed("has empty prompt_token_ids")
        bad = [lp for lp in logprobs if math.isnan(lp) or lp > 1e-4]
        if bad:
            raise malformed(f"has logprob {bad[0]!r}; logprobs must be <= 0")
        vocab = len(self.tokenizer)
        outside = [i for i in token_ids if i >= vocab]
        if outside:
            raise malformed(f"has token id {outside[0]} outside the tokenizer's vocabulary "
                            f"of {vocab}")
        reason = choice.get("finish_reason")
        finish: FinishReason | None
        if reason is None:
            finish = None
        elif isinstance(reason, str):
            finish = "length" if reason == "length" else "stop"
        else:
            raise malformed(f"has finish_reason {reason!r}")
        return token_ids, logprobs, prompt_ids, finish

