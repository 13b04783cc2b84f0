"""Generation at a remote trainer's completions endpoint (the RolloutServer side of the
remote-rollout protocol).

In the remote-rollout protocol the trainer owns the inference engine and this process drives
the agent loop. Each LLM call is one ``POST`` to the trainer's completions endpoint carrying
the *full* conversation:

.. code-block:: json

    {"model": "default", "rollout_id": "…", "messages": […], "tools": […],
     "response_mask": null, "temperature": 1.0, "top_p": 1.0, "max_tokens": 256,
     "logprobs": true}

Which endpoint. The protocol's first revision serves ``/v1/completions``, the later one
``/v1/chat/completions``, with the same body and answer; a RolloutRequest does not say which
revision its trainer speaks. So (``endpoint="auto"``, the default):

- a ``server_url`` that ends in ``/v1/chat/completions`` or ``/v1/completions`` names the
  endpoint itself: that path is used and stripped from the base URL;
- otherwise the first call goes to ``/v1/chat/completions`` (the current revision) and, when
  the trainer answers it 404 or 405 (no such route: nothing was generated, the trainer's
  buffer is untouched), the same body goes once to ``/v1/completions``. The path that
  answered is kept for the rest of the rollout (``path``); a trainer serving neither is
  unreachable (below), the log naming both paths.

``endpoint="chat"`` or ``"completions"`` fixes the path without probing.

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

Tool calls outside the token ids. Trainers of the later revision may answer with
``token_ids`` that hold only the message's content and put the tool calls in
``choices[0].message.tool_calls`` (OpenAI's form), or leave them as ``<tool_call>`` text in
``message.content``. When the text decoded from ``token_ids`` holds no tool-call tag, the
answer's tool calls are appended to it as ``<tool_call>`` blocks (``tool_calls`` first, else
the blocks found in ``content``), so the agent loop runs them. What is recorded stays what the
trainer sampled: ``response_ids`` and ``logprobs`` are the answer's ``token_ids`` and
``logprobs`` (content only), the recorded response message carries the tool calls. The
tool-call tokens are then not generated tokens of this call: they reach the trainer in the
next prompt, among the tokens the ``response_mask`` marks 0, exactly as the trainer's own
buffer (prompt + ``token_ids``) holds them; replay, which trains only on recorded response
ids, gives them loss mask 0 too. ``tool_calls_outside_ids`` counts such calls. An answer
without ``finish_reason`` finished its turn (``stop``) when its ids end in the end-of-turn
token, a stop string cut it, or it carries such tool calls; otherwise it was cut by
``max_tokens`` (``length``).

Trainer failures raise :class:`RemoteTrainerError` with a category. Until the trainer has
answered one call as a trainer, every failure (a closed port, a port that does not speak
HTTP, a timeout, any HTTP status, an answer that is not a completion) is category
``network`` with one message (:func:`unreachable_message`), so that a ``server_url`` cannot
be used to tell closed, non-HTTP and HTTP ports apart; the details go to the log. After
that:

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

import json
import logging
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from workers.engines.backend import FinishReason, GenerationRequest, GenerationResult
from workers.engines.prompt import decode_response, end_of_turn_ids, render_prompt_ids
from workers.engines.toolcall import parse_response

__all__ = [
    "TRAINER_ERROR_CATEGORIES",
    "unreachable_message",
    "RemoteTrainerBackend",
    "RemoteTrainerError",
    "answer_tool_calls_text",
    "session_response_mask",
    "split_endpoint",
]

TRAINER_ERROR_CATEGORIES = ("rate_limited", "server_error", "client_error", "network",
                            "malformed", "response_mask")

_log = logging.getLogger(__name__)


def unreachable_message(server_url: str) -> str:
    """The one message of a trainer that never answered as a trainer: the same for a closed
    port, a port that does not speak HTTP, and an HTTP server that is not a trainer."""
    return (f"the trainer at {server_url} is unreachable: no trainer answered there "
            "(the rollout worker's log has the details)")

_ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
#: ``endpoint="auto"``: the order in which the paths are tried (module docstring).
_PROBE_ORDER = ("chat", "completions")
_CALL_OPEN, _CALL_CLOSE = "<tool_call>", "</tool_call>"


def split_endpoint(server_url: str) -> tuple[str, str | None]:
    """``server_url`` without a trailing completions path, and the endpoint that path names
    (``"chat"``, ``"completions"``, or None when the URL is a base URL)."""
    base = server_url.rstrip("/")
    for name in _PROBE_ORDER:  # the chat path first: it ends with the other one's tail
        path = _ENDPOINTS[name]
        if base.endswith(path):
            return base[: -len(path)], name
    return base, None


def _tool_call_text(call: Any) -> str | None:
    """One OpenAI ``tool_calls`` entry as the ``<tool_call>`` block the loop parses; None for
    an entry that is not an object with a ``function``. Arguments given as JSON text that
    decodes to an object are written as that object; anything else is written as given, so
    the parser reports it as a format error answered in the conversation."""
    if not isinstance(call, Mapping):
        return None
    function = call.get("function")
    if not isinstance(function, Mapping):
        return None
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments)
        except ValueError:
            decoded = None
        if isinstance(decoded, dict):
            arguments = decoded
    payload = json.dumps({"name": function.get("name"), "arguments": arguments},
                         ensure_ascii=False)
    return f"{_CALL_OPEN}\n{payload}\n{_CALL_CLOSE}"


def answer_tool_calls_text(message: Any) -> str:
    """The tool calls of an answer's ``choices[0].message`` as ``<tool_call>`` blocks joined
    by newlines (module docstring): its ``tool_calls``, else the blocks in its ``content``;
    empty when it has none."""
    if not isinstance(message, Mapping):
        return ""
    calls = message.get("tool_calls")
    if isinstance(calls, list) and calls:
        blocks = [b for b in map(_tool_call_text, calls) if b is not None]
        return "\n".join(blocks)
    content = message.get("content")
    if isinstance(content, str) and _CALL_OPEN in content:
        start = content.index(_CALL_OPEN)
        end = content.rfind(_CALL_CLOSE)
        return content[start:end + len(_CALL_CLOSE)] if end > start else content[start:]
    return ""


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
    """A :class:`~workers.engines.backend.GenerationBackend` whose engine is a remote
    trainer's completions endpoint, keeping the RolloutSession state of one rollout (module
    docstring). Use one instance per rollout.

    ``server_url`` the trainer's base URL (or the endpoint's full URL); ``rollout_id``
    sent with every call; ``tokenizer`` the rollout's tokenizer (a transformers tokenizer with
    a chat template) used to measure prompts and decode generations; ``api_key`` sent as
    ``Authorization: Bearer``; ``endpoint`` ``"auto"`` (default: the path the URL names, else
    ``/v1/chat/completions`` falling back to ``/v1/completions``, module docstring),
    ``"chat"`` or ``"completions"``; ``model`` the ``model`` field; ``extra_body`` further
    sampling fields sent verbatim (``top_k``…); ``timeout_s`` per call.

    Raises ValueError for a URL that is not http(s), an empty ``rollout_id``, an unknown
    ``endpoint``, a non-positive timeout or a tokenizer without a chat template.
    ``generate`` raises :class:`RemoteTrainerError` for every trainer failure and remembers it
    in ``error``; requests given as ``prompt_ids`` raise ValueError (the protocol sends
    messages).
    """

    def __init__(self, server_url: str, *, rollout_id: str, tokenizer: Any,
                 api_key: str | None = None, endpoint: str = "auto",
                 model: str = "default", extra_body: Mapping[str, Any] | None = None,
                 timeout_s: float = 120.0, policy_version: int = 0) -> None:
        import httpx

        if not isinstance(server_url, str) or not server_url.startswith(("http://",
                                                                         "https://")):
            raise ValueError(f"server_url must be an http(s) URL, got {server_url!r}")
        if not isinstance(rollout_id, str) or not rollout_id:
            raise ValueError(f"rollout_id must be a non-empty string, got {rollout_id!r}")
        if endpoint not in (*_ENDPOINTS, "auto"):
            raise ValueError(f"endpoint must be one of {sorted(_ENDPOINTS) + ['auto']}, "
                             f"got {endpoint!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (
                math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number, got {timeout_s!r}")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("tokenizer must have a chat_template to measure prompts")
        if api_key is not None and not isinstance(api_key, str):
            raise TypeError(f"api_key must be a string or None, got {type(api_key).__name__}")
        base, named = split_endpoint(server_url)
        if endpoint == "auto":
            endpoint = named or "auto"
        self.server_url = base
        self.rollout_id = rollout_id
        self.tokenizer = tokenizer
        #: the endpoint in use; "auto" until the first call found the one the trainer serves
        self.endpoint = endpoint
        self.path = _ENDPOINTS[_PROBE_ORDER[0] if endpoint == "auto" else endpoint]
        self.model = model
        self.extra_body = dict(extra_body or {})
        self.policy_version = policy_version
        self.stop_token_ids = end_of_turn_ids(tokenizer)
        self.last_prompt_length = 0
        self.calls = 0
        self.prompt_length_mismatches = 0
        self.tool_calls_outside_ids = 0
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
            if self.calls == 0 and exc.category != "response_mask":
                # Before any trainer answer, every failure reads the same (module
                # docstring): the details stay in this process's log.
                _log.warning("trainer at %s: first call failed (%s): %s", self.server_url,
                             exc.category, exc)
                exc = RemoteTrainerError("network", unreachable_message(self.server_url))
            self.error = exc
            raise exc from None

    def _generate(self, request: GenerationRequest) -> GenerationResult:
        prompt = self.prompt_ids(request)
        mask = session_response_mask(prompt_length=len(prompt),
                                     last_prompt_length=self.last_prompt_length)
        body = self.request_body(request, mask)
        response = self._post(body)
        if self.endpoint == "auto":
            if response.status_code in (404, 405):  # no such route: try the other revision's
                tried = self.path
                self.path = _ENDPOINTS[_PROBE_ORDER[1]]
                response = self._post(body)
                if response.status_code in (404, 405):
                    raise RemoteTrainerError(
                        "client_error", f"the trainer at {self.server_url} answered "
                        f"{tried} and {self.path} with HTTP 404/405: it serves neither "
                        "completions path (or knows no such rollout)",
                        status_code=response.status_code)
            if response.status_code < 400:
                self.endpoint = next(k for k, v in _ENDPOINTS.items() if v == self.path)
        status = response.status_code
        if status >= 400:
            category = ("rate_limited" if status == 429 else
                        "server_error" if status >= 500 else "client_error")
            raise RemoteTrainerError(
                category, f"POST {self.path} returned HTTP {status} "
                f"({len(response.content)} bytes, not shown)", status_code=status)
        token_ids, logprobs, prompt_ids, finish, message = self._read_answer(response)
        self.calls += 1
        if len(prompt_ids) != len(prompt):
            self.prompt_length_mismatches += 1
        # The session's bookkeeping: the prompt as measured here plus what was generated.
        self.last_prompt_length = len(prompt) + len(token_ids)
        text, stopped_on_string = decode_response(self.tokenizer, token_ids,
                                                   stop=request.sampling.stop)
        outside = False
        if not parse_response(text, call_id="probe").attempted_tool_call:
            # Tool calls the answer carries outside its token ids (module docstring).
            calls = answer_tool_calls_text(message)
            outside = bool(calls)
            if calls:
                self.tool_calls_outside_ids += 1
                text = f"{text}\n{calls}" if text.strip() else calls
        if finish is None:
            # Ids without their end token (content only) and tool calls beside them: the
            # model finished its turn with those calls.
            ended = bool(token_ids) and token_ids[-1] in self.stop_token_ids
            finish = "stop" if ended or stopped_on_string or outside else "length"
        return GenerationResult(
            prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
            response_ids=np.asarray(token_ids, dtype=np.int32),
            logprobs=np.asarray(logprobs, dtype=np.float32),
            text=text,
            finish_reason=finish,
            policy_version=self.policy_version,
        )

    def _post(self, body: dict[str, Any]) -> Any:
        import httpx

        try:
            return self.client.post(self.path, json=body)
        except httpx.TransportError as exc:  # connect, read, write, timeout, protocol
            raise RemoteTrainerError(
                "network", f"POST {self.server_url}{self.path} failed: "
                f"{type(exc).__name__}: {exc}") from None

    def _read_answer(self, response: Any
                     ) -> tuple[list[int], list[float], list[int], FinishReason | None, Any]:
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
        return token_ids, logprobs, prompt_ids, finish, choice.get("message")

