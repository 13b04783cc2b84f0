"""Remote rollouts (the RolloutServer side of the TrainGate protocol), played on a rollout
worker: the trainer sends a RolloutRequest (checked by :mod:`workers.rollout.remote_request`,
format there), this process drives the agent loop and generates at the trainer's endpoint.

:func:`run_remote_rollout` plays the request and returns the RolloutResponse::

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
                 "total_latency_ms": …, "llm_latency_ms": …, "tool_latency_ms": …,
                 "prompt_tokens": …, "max_context_tokens": …}}

Semantics:

- Every LLM call goes to the trainer through
  :class:`~workers.engines.backend_remote.RemoteTrainerBackend`, which sends the explicit
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
- The episode is recorded like any other (``episode_started`` … ``episode_finished``)
  under episode id ``rollout-<rollout_id>`` in run ``run_id``, without a
  ``reward_assigned``: the trainer scores ``final_messages`` itself (reward ``unscored``), and
  may post that reward to ``/v1/episodes/rollout-<rollout_id>/reward`` later; until then the
  episode is not trainable here (``no_reward``).
- Trainer failures (HTTP 429, 5xx, other 4xx, network errors, malformed answers, a prompt that
  shrank) never raise: the episode ends with status ``error`` and the response has status
  ``ERROR``, ``error_category`` and ``error_message``. So do failures of tools or of the loop.
- The API queues each rollout on the rollout queue (:mod:`workers.rollout.remote_dispatch`);
  the worker's task calls :func:`play_and_answer` for ``POST /rollout`` (the response goes
  back to the waiting request) and :func:`play_and_report` for ``POST /v1/rollout/init``
  (the response is posted to the trainer's ``/v1/rollout/completed``:
  :func:`post_rollout_completed`, retried on network errors, 408, 425, 429 and 5xx).
- A request that is not valid raises ValueError naming the field; a ``rollout_id`` that was
  already recorded raises :class:`DuplicateRolloutError` (a ValueError). Failures of the store
  itself (database down) propagate from :func:`run_remote_rollout`; the two task bodies turn
  them into an ``ERROR`` response with ``error_category`` ``rollout_server``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from store.errors import ConflictError, IdempotencyError, NotFoundError
from store.events import Event, LLMCalled, RollbackConfig, RunConfig, ToolReturned
from store.settings import Settings
from workers.engines.backend_remote import RemoteTrainerBackend
from workers.rollout.agent_tasks import Task
from workers.rollout.episode_writer import EpisodeWriter, VersionedLog
from workers.rollout.loop import EpisodeResult, run_episode
from workers.rollout.remote_dispatch import RolloutAnswer, push_answer
from workers.rollout.remote_request import (
    DuplicateRolloutError,
    RolloutRequest,
    check_trainer_host,
    parse_rollout_request,
    remote_episode_id,
    resolve_tokenizer,
)
from workers.rollout.tools import ToolRegistry
from workers.rollout.user_tools import offered_tools

__all__ = [
    "completion_url",
    "play_and_answer",
    "play_and_report",
    "post_rollout_completed",
    "rollout_tools",
    "run_remote_rollout",
]

_log = logging.getLogger(__name__)
_NAMESPACE = uuid.UUID("6f1b7a52-3c1e-4d0a-9a57-2f0c1f7e5b11")


def _finish_reason(result: EpisodeResult) -> str | None:
    if result.status == "error":
        return None
    if result.status == "truncated":
        return "max_turns" if (result.reason or "").startswith("max_turns") else "max_tokens"
    return "stop"


class _Tap:
    """The store, passed through, keeping the events appended (for the metrics)."""

    def __init__(self, store: VersionedLog) -> None:
        self.store = store
        self.events: list[Event] = []
        if getattr(store, "aappend", None) is not None:  # keep the store's batched writes
            self.aappend = self._aappend

    def append(self, stream_id: str, events: Sequence[Event], expected_version: Any = ...
               ) -> Any:
        result = self.store.append(stream_id, events, expected_version)
        self.events.extend(events)
        return result

    async def _aappend(self, stream_id: str, events: Sequence[Event],
                       expected_version: Any = ...) -> Any:
        result = await self.store.aappend(stream_id, events, expected_version)  # type: ignore[attr-defined]
        self.events.extend(events)
        return result

    def stream_version(self, stream_id: str) -> int:
        return self.store.stream_version(stream_id)


def _run_config(store: Any, run_id: str) -> RunConfig:
    """The run's configuration where the log can say (defaults otherwise: a run that does not
    exist yet, or a log that reads no runs)."""
    for name in ("run_config", "get_run"):
        read = getattr(store, name, None)
        if read is None:
            continue
        try:
            found = read(run_id)
        except NotFoundError:
            return RunConfig()
        return found if isinstance(found, RunConfig) else found.config
    return RunConfig()


def rollout_tools(parsed: RolloutRequest, *, store: Any, settings: Settings) -> ToolRegistry:
    """The tools rollout ``parsed`` offers: the server's, its run's and its request's
    ``tool_server_url`` (:func:`~workers.rollout.user_tools.offered_tools`). ValueError naming
    the source when one cannot be loaded or two give one name."""
    if parsed.tool_server_url:
        check_trainer_host(parsed.tool_server_url, settings, field="tool_server_url")
    config = _run_config(store, parsed.run_id).rollout
    return offered_tools(settings, modules=config.tool_modules, mcp_servers=config.mcp_servers,
                         tool_server_url=parsed.tool_server_url)


def _metrics(events: Sequence[Event]) -> dict[str, float | int]:
    """The reference RolloutMetrics' latencies and token counts, from the recorded events."""
    llm = [e for e in events if isinstance(e, LLMCalled)]
    prompts = [int((e.usage or {}).get("prompt_tokens", len(e.prompt_ids))) for e in llm]
    return {"llm_latency_ms": float(sum(e.latency_ms or 0.0 for e in llm)),
            "tool_latency_ms": float(sum(e.duration_ms or 0.0 for e in events
                                         if isinstance(e, ToolReturned))),
            "prompt_tokens": sum(prompts),
            "max_context_tokens": max(prompts, default=0)}


def run_remote_rollout(request: Mapping[str, Any], *, store: VersionedLog,
                       settings: Settings, tools: ToolRegistry | None = None,
                       timeout_s: float = 120.0) -> dict[str, Any]:
    """Play one remote rollout and return its RolloutResponse dict (module docstring).

    ``store`` the event log the episode is appended to; ``settings`` locate the data
    directory (the ``tiny`` tokenizer); ``tools`` the tools offered to the model (default:
    :func:`rollout_tools`, the server's, the run's and the request's; the calculator when
    none is given); ``timeout_s`` per trainer call. Tool calls of the turn that reaches
    ``max_turns`` run before the rollout ends (``finish_reason`` ``max_turns``), as the
    reference RolloutServer runs them. Trainer and tool failures come back as
    status ``ERROR``; an invalid request raises ValueError naming the field, a rollout id
    recorded before :class:`DuplicateRolloutError`.
    """
    parsed = parse_rollout_request(request)
    if not isinstance(settings, Settings):
        raise TypeError(f"settings must be Settings, got {type(settings).__name__}")
    if tools is None:
        tools = rollout_tools(parsed, store=store, settings=settings)
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
    tap = _Tap(store)
    writer = EpisodeWriter(tap, namespace=uuid.uuid5(_NAMESPACE, episode_id))
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
                max_total_tokens=parsed.max_tokens_total, policy_version=0,
                last_turn_tools=True)
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
            **_metrics(tap.events),
        },
    }


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
    import tenacity

    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
        raise ValueError(f"attempts must be a positive integer, got {attempts!r}")
    if not isinstance(backoff_s, int | float) or backoff_s < 0:
        raise ValueError(f"backoff_s must be a number >= 0, got {backoff_s!r}")
    url = completion_url(server_url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rollout_id = response.get("rollout_id")
    last: list[int | None] = [None]  # the status of the latest answer

    def transient(outcome: tenacity.RetryCallState) -> bool:
        failed = outcome.outcome
        if failed is None:
            return False
        if failed.failed:
            return isinstance(failed.exception(), httpx.TransportError)
        return failed.result() in _TRANSIENT

    def warn(state: tenacity.RetryCallState) -> None:
        failed = state.outcome
        what = (str(failed.exception()) if failed is not None and failed.failed
                else f"answered {last[0]}")
        _log.warning("rollout %s: completion callback to %s %s (try %d of %d)", rollout_id,
                     url, what if what.startswith("answered") else f"failed: {what}",
                     state.attempt_number, attempts)

    with httpx.Client(timeout=timeout_s, follow_redirects=False) as client:
        def post() -> int:
            status = client.post(url, json=dict(response), headers=headers).status_code
            last[0] = status
            return status

        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(attempts),
            wait=tenacity.wait_exponential(multiplier=backoff_s, exp_base=2, min=0),
            retry=transient, before_sleep=warn, retry_error_callback=lambda _: last[0],
            reraise=False)
        status = retrying(post)
    if status is not None and status < 300:
        return status
    _log.error("rollout %s: the trainer at %s never took the completion callback (last "
               "answer: %s)", rollout_id, url, status)
    return status


def _server_error(request: Mapping[str, Any], exc: Exception) -> dict[str, Any]:
    """The RolloutResponse of a rollout that failed for a reason that is not the trainer's
    (the store unreachable, a bug): status ``ERROR``, ``error_category`` ``rollout_server``."""
    return {"rollout_id": request.get("rollout_id"), "status": "ERROR",
            "finish_reason": None, "final_messages": list(request.get("messages") or []),
            "error_message": f"rollout_server: {type(exc).__name__}: {exc}",
            "error_category": "rollout_server",
            "episode_id": remote_episode_id(str(request.get("rollout_id"))),
            "metrics": {}}


def play_and_answer(request: Mapping[str, Any], *, store: VersionedLog, settings: Settings,
                    tools: ToolRegistry | None = None, timeout_s: float = 120.0
                    ) -> RolloutAnswer:
    """The synchronous revision's RolloutServer: play ``request`` (as
    :func:`run_remote_rollout`) and push the answer for the ``POST /rollout`` waiting on it
    (:func:`~workers.rollout.remote_dispatch.push_answer`): 200 with the RolloutResponse; 409
    for a rollout id recorded before; 422 for a request that is not valid (the route checked
    it, so only a changed setting gets here); a failure that is not the trainer's, 200 with
    status ``ERROR`` and ``error_category`` ``rollout_server``, as :func:`play_and_report`
    reports it. The body of the rollout queue's ``trajstore.remote_rollout`` task; returns
    the answer pushed and raises only when the broker cannot take it."""
    rollout_id = str(request.get("rollout_id"))
    try:
        answer = RolloutAnswer(200, body=run_remote_rollout(
            request, store=store, settings=settings, tools=tools, timeout_s=timeout_s))
    except DuplicateRolloutError as exc:
        answer = RolloutAnswer(409, code="already_exists", message=str(exc))
    except ValueError as exc:
        answer = RolloutAnswer(422, code="invalid_request", message=str(exc))
    except Exception as exc:  # answered: the caller waits for this rollout
        _log.exception("rollout %s failed", rollout_id)
        answer = RolloutAnswer(200, body=_server_error(request, exc))
    push_answer(settings, rollout_id, answer)
    return answer


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
    first request's report stands): returns None then, else the response posted. The body
    of the rollout queue's ``trajstore.remote_rollout_init`` task: it raises nothing."""
    try:
        response = run_remote_rollout(request, store=store, settings=settings, tools=tools,
                                      timeout_s=timeout_s)
    except DuplicateRolloutError:
        _log.info("rollout %s was recorded before; not played again",
                  request.get("rollout_id"))
        return None
    except Exception as exc:  # reported to the trainer, which waits for this rollout
        _log.exception("rollout %s failed", request.get("rollout_id"))
        response = _server_error(request, exc)
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
