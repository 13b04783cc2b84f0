"""The capture gateway the completion routes call.

Three ways a call goes, decided per request:

- **OpenAI-compatible capture**: the request goes to the upstream server (when
  ``gateway_upstream_url`` is set) or the in-process engine; the answer goes back to the
  caller as the engine gave it; when the request names an episode
  (``X-Trajstore-Episode``) the call is appended to it as an ``llm_called`` with the
  engine's exact prompt ids, generated ids and logprobs. Streamed answers are recorded once
  complete, before the final ``[DONE]``. An upstream failure returns the upstream's status
  and body and records nothing.
- In both recorded forms the tool results the history carries become ``tool_returned``
  facts before the call, and ``X-Trajstore-Abandoned`` marks an earlier call abandoned
  (``api.gateway.tool_facts``); the in-process engine streams as it samples
  (``api.gateway.streaming``) and records only runs of its own vocabulary.
- **Remote rollout** (a ``rollout_id`` in the body, TrainGate protocol): the gateway renders
  the prompt itself with the run's tokenizer, checks the ``response_mask`` against its token
  buffer (``rollout_buffer``), generates from the prompt ids, records the call with the
  check's outcome, and answers with ``token_ids``, ``logprobs`` and ``prompt_token_ids``.
  A rollout id not seen before is created on its first call, as the capture path creates
  episodes, in the run the request or its key names, else ``remote_default_run``.
- **Plain serving**: no episode and no rollout id: generate and answer, record nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from functools import partial
from typing import Any

import httpx
from fastapi.responses import JSONResponse, Response
from httpx_sse import EventSource, SSEError
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.concurrency import run_in_threadpool

from api.access import Access
from api.errors import ApiError, error_body, error_response, refuse_unstorable
from api.gateway.capture import Capture, EpisodeTarget, NewEpisode
from api.gateway.local_engine import LocalEngine, engine_model_dir
from api.gateway.messages import normalize_messages, sampling_params
from api.gateway.openai_format import (
    Captured,
    IncompleteAnswer,
    StreamAccumulator,
    assistant_message,
    captured_chat,
    captured_completion,
    chat_response,
    chat_tail_chunks,
    completion_chunks,
    completion_response,
    strip_extensions,
)
from api.gateway.rollout_buffer import RolloutBuffers, check_mask
from api.gateway.streaming import LiveText, chat_live_chunk, completion_live_chunk
from api.gateway.tool_facts import abandon_events, tool_results
from api.gateway.upstream import Upstream
from api.keys import ApiKey
from api.schemas.openai import ChatCompletionRequest, CompletionRequest
from store import errors as store_errors
from store import heap, queries
from store.eventlog import EventStore
from store.events import Event
from store.settings import Settings
from workers.engines.backend import GenerationRequest, GenerationResult, SamplingParams
from workers.engines.content_tokens import ControlTokenInContent
from workers.engines.prompt import decode_response
from workers.engines.render import prompt_ids

__all__ = ["Gateway"]

log = logging.getLogger(__name__)

_ABANDONED = "header.X-Trajstore-Abandoned"
#: The end of an OpenAI stream.
_DONE = ServerSentEvent(data="[DONE]")


def _event(chunk: dict[str, Any]) -> ServerSentEvent:
    """One chunk of an OpenAI stream as a server-sent event."""
    return ServerSentEvent(data=json.dumps(chunk, separators=(",", ":")))


def _event_stream(events: AsyncIterator[ServerSentEvent]) -> EventSourceResponse:
    """``events`` sent as OpenAI sends a stream (sse-starlette: LF-separated ``data:``
    events, no caching or proxy buffering, a comment every 15 s on a quiet connection)."""
    return EventSourceResponse(events, sep="\n", ping=15)


def _passthrough(status: int, content: bytes, content_type: str | None) -> Response:
    """An upstream error answer, status and body unchanged when the body is JSON."""
    try:
        json.loads(content)
    except ValueError:
        return error_response(status, "upstream_error",
                              f"the upstream server answered {status}: "
                              f"{content[:500].decode(errors='replace')}")
    return Response(content, status_code=status,
                    media_type=content_type or "application/json")


def _engine_error(exc: Exception) -> ApiError:
    return ApiError(422, "invalid_prompt", f"the engine refused the request: {exc}")


def _engine_failure(exc: BaseException) -> BaseException:
    """What a failed generation raises: 422 for a request the engine refuses (bad ids, too
    long, a chat template error on odd messages, content spelling a control token: named by
    its field), else the error itself."""
    if isinstance(exc, ControlTokenInContent):
        return ApiError(422, "control_token_in_content", str(exc).replace(
            exc.field, f"body.{exc.field}", 1), field=f"body.{exc.field}")
    if isinstance(exc, (ValueError, TypeError)) or type(exc).__module__.startswith("jinja2"):
        return _engine_error(exc)  # type: ignore[arg-type]
    return exc


class _Form:
    """What differs between the two OpenAI endpoints on the capture path (one subclass per
    endpoint; :meth:`Gateway._serve` is the path itself)."""

    chat: bool
    id_prefix: str

    def check(self, body: Any) -> None:
        """Refuse (ApiError 422) what this endpoint does not take."""

    def conversation(self, body: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The messages and tools the call is recorded with."""
        return [], None

    def want_logprobs(self, body: Any) -> bool:
        raise NotImplementedError

    def max_tokens(self, body: Any) -> int | None:
        return body.max_tokens  # type: ignore[no-any-return]

    def request(self, body: Any, engine: LocalEngine, sampling: SamplingParams,
                messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                ) -> GenerationRequest:
        raise NotImplementedError

    def parse_tools(self, body: Any, tools: list[dict[str, Any]] | None) -> bool:
        return False

    def message(self, text: str, *, call_id: str, parse_tools: bool) -> dict[str, Any]:
        """The answer as the assistant message recorded."""
        return {"role": "assistant", "content": text}

    def response(self, *, message: dict[str, Any], **common: Any) -> dict[str, Any]:
        raise NotImplementedError


class _ChatForm(_Form):
    chat = True
    id_prefix = "chatcmpl"

    def conversation(self, body: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        return normalize_messages(body.messages), body.tools or None

    def want_logprobs(self, body: Any) -> bool:
        return bool(body.logprobs)

    def max_tokens(self, body: Any) -> int | None:
        return body.max_completion_tokens or body.max_tokens  # type: ignore[no-any-return]

    def request(self, body: Any, engine: LocalEngine, sampling: SamplingParams,
                messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                ) -> GenerationRequest:
        return GenerationRequest(sampling=sampling, messages=tuple(messages),
                                 tools=tuple(tools) if tools else None)

    def parse_tools(self, body: Any, tools: list[dict[str, Any]] | None) -> bool:
        return bool(tools) and body.tool_choice != "none"

    def message(self, text: str, *, call_id: str, parse_tools: bool) -> dict[str, Any]:
        return assistant_message(text, call_id=call_id, parse_tools=parse_tools)

    def response(self, *, message: dict[str, Any], **common: Any) -> dict[str, Any]:
        return chat_response(**common, message=message)


class _CompletionForm(_Form):
    chat = False
    id_prefix = "cmpl"

    def check(self, body: Any) -> None:
        if body.messages is not None or body.prompt is None:
            raise ApiError(422, "invalid_request", "a completion needs a prompt (messages go "
                           "to /v1/chat/completions, or come with a rollout_id)",
                           field="body.prompt")
        if body.echo:
            raise ApiError(422, "invalid_request", "echo is not supported", field="body.echo")

    def want_logprobs(self, body: Any) -> bool:
        return body.logprobs is not None and body.logprobs is not False

    def request(self, body: Any, engine: LocalEngine, sampling: SamplingParams,
                messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                ) -> GenerationRequest:
        ids = engine.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        if not ids:
            raise ApiError(422, "invalid_request", "the prompt encodes to no tokens",
                           field="body.prompt")
        return GenerationRequest(sampling=sampling, prompt_ids=tuple(ids))

    def response(self, *, message: dict[str, Any], **common: Any) -> dict[str, Any]:
        return completion_response(**common, text=message["content"])


_CHAT = _ChatForm()
_COMPLETION = _CompletionForm()


class Gateway:
    """The capture gateway of one API process (engine and upstream made on first use)."""

    def __init__(self, settings: Settings, store: EventStore, access: Access) -> None:
        self.settings, self.store, self.access = settings, store, access
        from workers.engines.tokenizers import allowed_roots

        # A model name reaches a new run's tokenizer from the client only through an
        # upstream server; the in-process engine names its own folder.
        self.capture = Capture(store, access, tokenizer_roots=allowed_roots(settings)
                               if settings.gateway_upstream_url else None)
        self.buffers = RolloutBuffers(store)
        self._engine: LocalEngine | None = None
        self._engine_refused: str | None = None
        self._engine_lock = threading.Lock()
        self._engine_runs: set[str] = set()  # runs whose tokenizer is the engine's
        self._upstream: Upstream | None = None

    # --- backends ---------------------------------------------------------------------------

    @property
    def has_upstream(self) -> bool:
        return bool(self.settings.gateway_upstream_url)

    def engine(self) -> LocalEngine:
        """The in-process engine, loaded on first use. ApiError 503 when none is
        configured."""
        with self._engine_lock:
            if self._engine is None:
                try:
                    folder = engine_model_dir(self.settings)
                except ValueError as exc:
                    raise ApiError(503, "no_engine", str(exc)) from None
                if folder is None:
                    raise ApiError(503, "no_engine", "no generation backend is configured: "
                                   "set TRAJSTORE_GATEWAY_UPSTREAM_URL or "
                                   "TRAJSTORE_GATEWAY_ENGINE_MODEL")
                if self._engine_refused is not None:
                    raise ApiError(503, "no_engine", self._engine_refused)
                try:
                    self._engine = LocalEngine(folder,
                                               device=self.settings.gateway_engine_device,
                                               name=self.settings.gateway_model_name)
                except ValueError as exc:
                    self._engine_refused = f"the in-process engine is refused: {exc}"
                    raise ApiError(503, "no_engine", self._engine_refused) from None
                heap.loaded()  # the model is long-lived: out of full collections
            return self._engine

    def upstream(self) -> Upstream:
        if self._upstream is None:
            self._upstream = Upstream(self.settings)
        return self._upstream

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()

    async def aclose(self) -> None:
        if self._upstream is not None:
            await self._upstream.aclose()
            self._upstream = None

    async def _generate(self, request: GenerationRequest) -> GenerationResult:
        engine = await run_in_threadpool(self.engine)
        try:
            return await run_in_threadpool(engine.generate, request)
        except Exception as exc:
            raise _engine_failure(exc) from None

    async def _stream_engine(self, request: GenerationRequest, *, form: _Form,
                             parse_tools: bool, target: EpisodeTarget | None,
                             record: dict[str, Any], want_logprobs: bool,
                             return_token_ids: bool, include_usage: bool
                             ) -> EventSourceResponse:
        """Stream the in-process engine's answer as it samples (``api.gateway.streaming``);
        the call is recorded once complete, exactly as the same call unstreamed, before the
        final ``[DONE]``. A request the engine refuses is answered 422 before the stream
        starts."""
        engine = await run_in_threadpool(self.engine)
        try:
            prompt = await run_in_threadpool(engine.prompt_ids, request)
        except Exception as exc:
            raise _engine_failure(exc) from None
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def put(kind: str, value: Any) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, value))

        def work() -> None:
            try:
                put("done", engine.generate(request, lambda token: put("token", token)))
            except BaseException as exc:  # handed to the stream; nothing is lost
                put("error", exc)

        started = time.perf_counter()
        worker = asyncio.ensure_future(run_in_threadpool(work))
        first = await queue.get()
        if first[0] == "error":
            raise _engine_failure(first[1]) from None
        chat = form.chat
        stop = request.sampling.stop
        live = LiveText(lambda ids: decode_response(engine.tokenizer, ids, stop=stop)[0],
                        chat=chat, tools=parse_tools, stop=stop)
        call_id = f"{form.id_prefix}-{uuid.uuid4().hex}"
        created = int(time.time())
        live_chunk = chat_live_chunk if chat else completion_live_chunk

        async def events() -> AsyncIterator[ServerSentEvent]:
            line = _event
            if chat:
                opening: dict[str, Any] = {
                    "id": call_id, "object": "chat.completion.chunk", "created": created,
                    "model": engine.name, "choices": [{
                        "index": 0, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None}]}
                if return_token_ids:
                    opening["prompt_token_ids"] = prompt
                yield line(opening)
            item = first
            while item[0] == "token":
                piece = live.feed(item[1])
                if piece:
                    yield line(live_chunk(request_id=call_id, created=created,
                                          model=engine.name, text=piece))
                item = await queue.get()
            await worker
            if item[0] == "error":
                log.warning("streamed generation failed: %s", item[1])
                yield line(error_body("engine_error", f"the engine failed: {item[1]}"))
                yield _DONE
                return
            result: GenerationResult = item[1]
            latency = (time.perf_counter() - started) * 1000
            message = form.message(result.text, call_id=call_id, parse_tools=parse_tools)
            captured = self._captured(result, message)
            try:
                await self._record(target, captured, call_id=call_id, latency_ms=latency,
                                   **record)
            except store_errors.StoreError as exc:
                log.warning("streamed call not recorded: %s", exc)
                yield line(error_body("not_recorded", f"the call was not recorded: {exc}"))
                yield _DONE
                return
            common: dict[str, Any] = dict(
                request_id=call_id, created=created, model=engine.name,
                finish_reason=result.finish_reason,
                prompt_ids=captured.prompt_ids, response_ids=captured.response_ids,
                logprobs=captured.logprobs, token_text=engine.token_text,
                want_logprobs=want_logprobs, return_token_ids=return_token_ids,
                include_usage=include_usage)
            if chat:
                tail = chat_tail_chunks(**common, message=message, sent=live.sent)
            else:
                text = result.text
                tail = completion_chunks(
                    **common, text=text[len(live.sent):] if text.startswith(live.sent)
                    else "")
                if return_token_ids:
                    tail[0]["choices"][0]["prompt_token_ids"] = captured.prompt_ids
            for chunk in tail:
                yield line(chunk)
            yield _DONE

        return _event_stream(events())

    async def _target(self, key: ApiKey, episode: str | None, new: NewEpisode | None = None
                      ) -> EpisodeTarget | None:
        if episode is None:
            if new is not None:
                raise ApiError(422, "invalid_request", "a run id needs an episode id too "
                               "(X-Trajstore-Episode, or the path's episode)",
                               field="header.X-Trajstore-Episode")
            return None
        if new is not None and new.model is None and not self.has_upstream:
            # The in-process engine's own folder names its tokenizer exactly.
            folder = await run_in_threadpool(engine_model_dir, self.settings)
            new = replace(new, model=str(folder) if folder else None)
        if not self.has_upstream and self.settings.gateway_engine_model:
            await run_in_threadpool(self._check_engine_vocabulary, key, episode, new)
        # Nothing is created until the call is recorded: a refused call leaves no run and no
        # episode behind (``Capture.planned_target``).
        return await run_in_threadpool(self.capture.planned_target, key, episode, new)

    def _check_engine_vocabulary(self, key: ApiKey, episode: str, new: NewEpisode | None
                                 ) -> None:
        """Refuse (409, naming both) to record into a run whose tokenizer is not the
        in-process engine's vocabulary: the ids the engine reads and writes would be recorded
        as another tokenizer's. Checked before anything is created; a run created by this
        call takes the engine's own tokenizer and needs no check."""
        from workers.engines.tokenizers import TokenizerNotFound, load_tokenizer

        store = self.store
        run_id = queries.episode_run(store, episode) or (new.run_id if new else None)
        if run_id is None or run_id in self._engine_runs:
            return
        if queries.run_record(store, run_id) is None:
            return
        self.access.check_run(key, run_id)
        config = store.get_run(run_id).config
        name = config.tokenizer_name
        if not name:
            return  # stored, but gives no samples until the run names a tokenizer
        engine = self.engine()
        try:
            tokenizer = load_tokenizer(name)
        except TokenizerNotFound as exc:
            raise ApiError(409, "tokenizer_not_found", f"run {run_id!r}: {exc}") from None
        if not engine.vocabulary_matches(tokenizer):
            raise ApiError(409, "tokenizer_mismatch",
                           f"run {run_id!r} uses tokenizer {name!r} ({len(tokenizer)} tokens) "
                           f"but this gateway's in-process engine {str(engine.model_dir)!r} "
                           f"has another vocabulary ({engine.vocabulary_size} tokens): its "
                           "token ids would be recorded as the run's. Record such runs "
                           "through an upstream server of the run's model, or name the "
                           "engine's tokenizer in the run")
        with self._engine_lock:
            if len(self._engine_runs) > 10_000:
                self._engine_runs.clear()
            self._engine_runs.add(run_id)

    # --- facts the history tells (api.gateway.tool_facts) -----------------------------------

    @staticmethod
    def _no_abandon_for_remote(abandoned: str | None) -> None:
        if abandoned is not None:
            raise ApiError(422, "invalid_request", "remote-rollout calls cannot abandon "
                           "attempts", field=_ABANDONED)

    async def _check_abandoned(self, episode: str | None, abandoned: str | None) -> None:
        """Refuse an abandonment that cannot name an earlier call, before anything (an
        episode created on first use included) is written."""
        if abandoned is None:
            return
        if not abandoned or len(abandoned) > 200:
            raise ApiError(422, "invalid_request", "X-Trajstore-Abandoned must name a call id "
                           "or 'previous'", field=_ABANDONED)
        if episode is None:
            raise ApiError(422, "invalid_request", "an abandoned attempt needs the episode it "
                           "belongs to (X-Trajstore-Episode, or the path's episode)",
                           field=_ABANDONED)
        if await run_in_threadpool(queries.episode_run, self.store, episode) is None:
            raise ApiError(422, "invalid_request", f"episode {episode!r} has no call to "
                           "abandon yet", field=_ABANDONED)

    async def _facts(self, target: EpisodeTarget | None, agent: str,
                     messages: list[dict[str, Any]], abandoned: str | None) -> list[Event]:
        if target is None:
            return []
        return await run_in_threadpool(self._derive_facts, target, agent, messages, abandoned)

    def _derive_facts(self, target: EpisodeTarget, agent: str,
                      messages: list[dict[str, Any]], abandoned: str | None) -> list[Event]:
        """The ``attempt_failed``/``rolled_back`` of the abandoned call, then the tool
        results of the history. ApiError 422 when ``abandoned`` names no call of ``agent``
        in the episode."""
        events: list[Event] = []
        if abandoned is not None:
            calls = [c for c in queries.episode_calls(self.store, target.episode_id)
                     if c.agent == agent]
            chosen = (calls[-1] if calls else None) if abandoned == "previous" else next(
                (c for c in calls if c.call_id == abandoned), None)
            if chosen is None:
                what = "no call yet" if abandoned == "previous" else f"no call {abandoned!r}"
                raise ApiError(422, "invalid_request", f"agent {agent!r} of episode "
                               f"{target.episode_id!r} made {what}", field=_ABANDONED)
            if not chosen.discarded:
                retry = sum(1 for c in calls if c.discarded and c.turn == chosen.turn)
                events += abandon_events(target.episode_id, agent=agent,
                                         call_id=chosen.call_id, turn=chosen.turn,
                                         retry_index=retry)
        events += tool_results(messages, episode_id=target.episode_id, agent=agent)
        return events

    async def _record(self, target: EpisodeTarget | None, captured: Captured, **kw: Any
                      ) -> None:
        if target is not None:
            await run_in_threadpool(lambda: self.capture.record(target, captured, **kw))

    # --- OpenAI-compatible capture ---------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest, *, key: ApiKey, episode: str | None,
                   agent: str, policy_version: int | None, run: str | None = None,
                   group: str | None = None, abandoned: str | None = None) -> Response:
        """``POST /v1/chat/completions``. A value the store would refuse (a NUL or lone
        surrogate, nesting past 64 levels, …) is answered 422 before anything is generated.
        The tool results in the history and the call ``abandoned`` names are recorded
        before the call (``api.gateway.tool_facts``)."""
        return await self._serve(_CHAT, body, key=key, episode=episode, agent=agent,
                                 policy_version=policy_version, run=run, group=group,
                                 abandoned=abandoned)

    async def completion(self, body: CompletionRequest, *, key: ApiKey, episode: str | None,
                         agent: str, policy_version: int | None, run: str | None = None,
                         group: str | None = None, abandoned: str | None = None) -> Response:
        """``POST /v1/completions``; refuses what ``chat`` refuses, and a request without a
        ``prompt`` (or with ``messages`` but no ``rollout_id``) or with ``echo``."""
        return await self._serve(_COMPLETION, body, key=key, episode=episode, agent=agent,
                                 policy_version=policy_version, run=run, group=group,
                                 abandoned=abandoned)

    async def _serve(self, form: _Form, body: Any, *, key: ApiKey, episode: str | None,
                     agent: str, policy_version: int | None, run: str | None,
                     group: str | None, abandoned: str | None) -> Response:
        """The one capture path of both endpoints; ``form`` holds what differs."""
        # The limits first (counts and sizes), then the walk over every value, off the event
        # loop: a body of 10,000 stop strings or 1,000 tools is refused without walking it,
        # and one just under the limits does not hold up every other request for its walk.
        self._check_limits(body)
        await run_in_threadpool(refuse_unstorable, body)
        self.access.check_scope(key, body.rollout_id if body.rollout_id is not None
                                else episode)
        if body.rollout_id is not None:
            self._no_abandon_for_remote(abandoned)
            return await self.remote(body, key=key, agent=agent, policy_version=policy_version,
                                     run=run, episode=episode, group=group)
        form.check(body)
        messages, tools = form.conversation(body)
        new = NewEpisode(run_id=run, group_id=group, messages=messages, tools=tools or [],
                         model=body.model if self.has_upstream else None) if run else None
        await self._check_abandoned(episode, abandoned)
        target = await self._target(key, episode, new)
        facts = await self._facts(target, agent, messages, abandoned)
        want_logprobs = form.want_logprobs(body)
        record: dict[str, Any] = {"agent": agent, "messages": messages, "tools": tools,
                                  "policy_version": policy_version, "facts": facts}
        if self.has_upstream:
            return await self._forward(body.model_dump(exclude_unset=True), chat=form.chat,
                                       target=target, want_logprobs=want_logprobs,
                                       want_ids=bool(body.return_token_ids),
                                       stream=bool(body.stream), record=record)
        sampling = sampling_params(temperature=body.temperature, top_p=body.top_p,
                                   max_tokens=form.max_tokens(body), seed=body.seed,
                                   stop=body.stop, cap=self.settings.gateway_max_tokens)
        engine = await run_in_threadpool(self.engine)
        request = form.request(body, engine, sampling, messages, tools)
        parse_tools = form.parse_tools(body, tools)
        if body.stream:
            return await self._stream_engine(
                request, form=form, parse_tools=parse_tools, target=target, record=record,
                want_logprobs=want_logprobs, return_token_ids=bool(body.return_token_ids),
                include_usage=bool((body.stream_options or {}).get("include_usage")))
        started = time.perf_counter()
        result = await self._generate(request)
        latency = (time.perf_counter() - started) * 1000
        call_id = f"{form.id_prefix}-{uuid.uuid4().hex}"
        message = form.message(result.text, call_id=call_id, parse_tools=parse_tools)
        captured = self._captured(result, message)
        await self._record(target, captured, call_id=call_id, latency_ms=latency, **record)
        return JSONResponse(form.response(
            message=message, request_id=call_id, created=int(time.time()), model=engine.name,
            finish_reason=result.finish_reason, prompt_ids=captured.prompt_ids,
            response_ids=captured.response_ids, logprobs=captured.logprobs,
            return_token_ids=bool(body.return_token_ids),
            token_text=engine.token_text if want_logprobs else None))

    def _check_limits(self, body: Any) -> None:
        """Refuse, before anything is created or generated, a call whose ``stop`` list or
        ``tools`` pass the gateway's limits: more than ``gateway_max_stop`` stop strings or
        one longer than ``gateway_max_stop_bytes`` (UTF-8), more than ``gateway_max_tools``
        tools or one whose JSON is over ``gateway_max_tool_bytes``. ApiError 422
        ``limit_exceeded`` naming the field, the limit and its setting."""
        settings = self.settings
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        tools = list(body.tools or [])
        checks: list[tuple[int, int, str, str, str]] = [
            (len(stops), settings.gateway_max_stop, "gateway_max_stop", "body.stop",
             "stop strings"),
            (len(tools), settings.gateway_max_tools, "gateway_max_tools", "body.tools", "tools"),
        ]
        for index, text in enumerate(stops[:settings.gateway_max_stop]):
            checks.append((len(text.encode("utf-8", "surrogatepass")),
                           settings.gateway_max_stop_bytes, "gateway_max_stop_bytes",
                           f"body.stop[{index}]" if isinstance(body.stop, list)
                           else "body.stop", "bytes in one stop string"))
        for index, tool in enumerate(tools[:settings.gateway_max_tools]):
            checks.append((len(json.dumps(tool, ensure_ascii=False).encode(
                "utf-8", "surrogatepass")), settings.gateway_max_tool_bytes,
                "gateway_max_tool_bytes", f"body.tools[{index}]", "bytes of JSON in one tool"))
        for found, limit, setting, field, what in checks:
            if found > limit:
                raise ApiError(422, "limit_exceeded",
                               f"{field}: {found} {what}, over this gateway's limit of {limit} "
                               f"(setting {setting})", field=field, limit=limit,
                               setting=setting)

    @staticmethod
    def _captured(result: GenerationResult, message: dict[str, Any]) -> Captured:
        finish = "tool_calls" if message.get("tool_calls") and result.finish_reason == "stop" \
            else result.finish_reason
        prompt, response = result.prompt_ids.tolist(), result.response_ids.tolist()
        return Captured(prompt_ids=prompt, response_ids=response,
                        logprobs=result.logprobs.tolist(), message=message,
                        finish_reason=finish,
                        usage={"prompt_tokens": len(prompt), "completion_tokens": len(response),
                               "total_tokens": len(prompt) + len(response)})

    async def _forward(self, body: dict[str, Any], *, chat: bool,
                       target: EpisodeTarget | None, want_logprobs: bool, want_ids: bool,
                       stream: bool, record: dict[str, Any]) -> Response:
        upstream = self.upstream()
        path = "/chat/completions" if chat else "/completions"
        payload = upstream.prepare(body, chat=chat)
        started = time.perf_counter()
        if not stream:
            answer = await upstream.post(path, payload)
            if answer.status_code >= 400:
                return _passthrough(answer.status_code, answer.content,
                                    answer.headers.get("content-type"))
            try:
                data = answer.json()
                captured = captured_chat(data) if chat else captured_completion(data)
            except (ValueError, IncompleteAnswer) as exc:
                raise ApiError(502, "upstream_incomplete", str(exc)) from None
            latency = (time.perf_counter() - started) * 1000
            await self._record(target, captured, call_id=str(data.get("id") or uuid.uuid4()),
                               latency_ms=latency, **record)
            strip_extensions(data, keep_logprobs=want_logprobs, keep_token_ids=want_ids)
            return JSONResponse(data, status_code=answer.status_code)
        answer = await upstream.open_stream(path, payload)
        if answer.status_code >= 400:
            content = await answer.aread()
            await answer.aclose()
            return _passthrough(answer.status_code, content, answer.headers.get("content-type"))
        return _event_stream(
            self._relay(answer, chat=chat, target=target, want_logprobs=want_logprobs,
                        want_ids=want_ids, record=record, started=started))

    async def _relay(self, answer: httpx.Response, *, chat: bool, target: EpisodeTarget | None,
                     want_logprobs: bool, want_ids: bool, record: dict[str, Any],
                     started: float) -> AsyncIterator[ServerSentEvent]:
        """Relay an upstream stream chunk by chunk (read as server-sent events by httpx-sse);
        record the call when ``[DONE]`` comes. An upstream that does not answer with an
        event stream ends the relay with an ``upstream_incomplete`` error event."""
        acc = StreamAccumulator(chat=chat)
        call_id: str | None = None
        try:
            async for sent in EventSource(answer).aiter_sse():
                data = sent.data.strip()
                if data == "[DONE]":
                    try:
                        await self._record(target, acc.result(),
                                           call_id=call_id or str(uuid.uuid4()),
                                           latency_ms=(time.perf_counter() - started) * 1000,
                                           **record)
                    except (IncompleteAnswer, store_errors.StoreError) as exc:
                        log.warning("streamed call not recorded: %s", exc)
                        yield _event(error_body("not_recorded",
                                                f"the call was not recorded: {exc}"))
                    yield _DONE
                    return
                try:
                    chunk = json.loads(data)
                except ValueError:
                    continue
                if isinstance(chunk, dict):
                    call_id = call_id or chunk.get("id")
                    acc.feed(chunk)
                    strip_extensions(chunk, keep_logprobs=want_logprobs,
                                     keep_token_ids=want_ids)
                yield _event(chunk)
        except SSEError as exc:
            log.warning("upstream stream unreadable: %s", exc)
            yield _event(error_body("upstream_incomplete",
                                    f"the upstream server did not stream events: {exc}"))
            yield _DONE
        finally:
            await answer.aclose()

    # --- remote rollout (TrainGate) --------------------------------------------------------

    async def remote(self, body: ChatCompletionRequest | CompletionRequest, *, key: ApiKey,
                     agent: str, policy_version: int | None, run: str | None = None,
                     episode: str | None = None, group: str | None = None) -> JSONResponse:
        """A remote-rollout call (module docstring). The rollout is the episode
        ``rollout_id``; one not seen yet is created on this first call (``remote_run``).
        ``run``/``episode``/``group``: what the ``X-Trajstore-*`` headers or the
        ``/v1/runs/{run}/episodes/{episode}/`` path name; an episode other than the rollout
        id is 422 naming ``body.rollout_id``."""
        from workers.engines.tokenizers import TokenizerNotFound, load_tokenizer

        if body.stream:
            raise ApiError(422, "invalid_request", "remote-rollout calls are not streamed",
                           field="body.stream")
        if not body.messages:
            raise ApiError(422, "invalid_request", "a remote-rollout call carries the full "
                           "messages", field="body.messages")
        rollout_id = body.rollout_id or ""
        if episode is not None and episode != rollout_id:
            raise ApiError(422, "invalid_request", f"the request names episode "
                           f"{episode[:60]!r} (X-Trajstore-Episode, or the path) but its "
                           f"rollout_id is {rollout_id[:60]!r}: a rollout is recorded as the "
                           "episode of its rollout id", field="body.rollout_id")
        messages = normalize_messages(body.messages)
        target = await self._remote_target(key, body, rollout_id, run=run, group=group,
                                           messages=messages)
        tools = body.tools or target.tools or None
        config = target.config
        try:
            tokenizer = await run_in_threadpool(load_tokenizer, config.tokenizer_name)
        except TokenizerNotFound as exc:
            raise ApiError(409, "tokenizer_not_found", str(exc)) from None
        try:
            prompt = await run_in_threadpool(partial(prompt_ids, tokenizer, messages,
                                                     tools=tools,
                                                     chat_template=config.chat_template))
        except Exception as exc:  # the template refused these messages
            raise ApiError(422, "template_error", f"the run's chat template cannot render "
                           f"these messages: {exc}", field="body.messages") from None
        facts = await self._facts(target, agent, messages, None)
        version, buffer = await run_in_threadpool(self.buffers.get, rollout_id, agent)
        check = check_mask(buffer, prompt, body.response_mask,
                           mask_sent="response_mask" in body.model_fields_set)
        sampling = sampling_params(temperature=body.temperature, top_p=body.top_p,
                                   max_tokens=getattr(body, "max_completion_tokens", None)
                                   or body.max_tokens, seed=body.seed, stop=body.stop,
                                   cap=self.settings.gateway_max_tokens)
        call_id = f"chatcmpl-{uuid.uuid4().hex}"
        started = time.perf_counter()
        response_ids, logprobs, text, finish, model = await self._remote_generate(
            prompt, sampling)
        latency = (time.perf_counter() - started) * 1000
        message = assistant_message(text, call_id=call_id, parse_tools=True)
        if message.get("content") is None:
            # A RolloutServer renders the message it gets back with its chat template;
            # templates concatenate content, so it is "" rather than null.
            message["content"] = ""
        finish_reason = "tool_calls" if message.get("tool_calls") and finish == "stop" \
            else finish
        captured = Captured(
            prompt_ids=prompt, response_ids=response_ids, logprobs=logprobs, message=message,
            finish_reason=finish_reason,
            usage={"prompt_tokens": len(prompt), "completion_tokens": len(response_ids),
                   "total_tokens": len(prompt) + len(response_ids)})
        result = await run_in_threadpool(lambda: self.capture.record(
            target, captured, agent=agent, call_id=call_id, messages=messages, tools=tools,
            latency_ms=latency, policy_version=policy_version, mask_check=check.to_dict(),
            expected_version=version, facts=facts))
        self.buffers.remember(rollout_id, agent, version=result.version, prompt_ids=prompt,
                              response_ids=response_ids)
        return JSONResponse({
            "id": call_id, "object": "chat.completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason,
                         "token_ids": response_ids}],
            "token_ids": response_ids, "logprobs": logprobs, "prompt_token_ids": prompt,
            "usage": captured.usage, "mask_check": check.to_dict(),
        })

    def remote_run(self, key: ApiKey, run: str | None) -> tuple[str, str] | None:
        """The run an unseen rollout id is created in, and where that came from (for
        errors): the run the request names (``run``: its header or path), else the key's
        own run (a credential scoped to one run), else ``remote_default_run``; None when
        nothing names one. A key scoped to a run that names another is 403."""
        if run is not None:
            if key.run_id is not None and run != key.run_id:
                raise ApiError(403, "forbidden", f"this key may record only into run "
                               f"{key.run_id!r}, not {run[:60]!r}",
                               field="header.X-Trajstore-Run")
            return run, "header.X-Trajstore-Run"
        if key.run_id is not None:
            return key.run_id, "the key's run"
        if self.settings.remote_default_run is not None:
            return self.settings.remote_default_run, "TRAJSTORE_REMOTE_DEFAULT_RUN"
        return None

    def _taken(self, key: ApiKey, episode_id: str) -> bool:
        """Whether ``episode_id`` exists in another project than the key's."""
        run_id = queries.episode_run(self.store, episode_id)
        return run_id is not None and self.access.run_project(run_id) != key.project

    def _refuse_taken(self, key: ApiKey, rollout_id: str) -> None:
        """409 when the rollout id is another project's episode; the answer names neither
        that project nor its run (nor says that it is another project's)."""
        if self._taken(key, rollout_id):
            raise ApiError(409, "rollout_id_taken", f"rollout id {rollout_id[:60]!r} is "
                           "already in use; give the rollout another id",
                           field="body.rollout_id")

    async def _remote_target(self, key: ApiKey, body: Any, rollout_id: str, *,
                             run: str | None, group: str | None,
                             messages: list[dict[str, Any]]) -> EpisodeTarget:
        """The rollout's episode, created on its first call as the gateway creates one
        (``Capture.target_or_create``: the run too when missing, in the key's project, with
        the tools of this call) in the run ``remote_run`` names. 404 naming the header and
        the setting when the rollout is unseen and nothing names a run; 409 when the id is
        another project's episode (before or after a concurrent first call); 403 for a run
        of another project; 409 for a finished rollout."""
        await run_in_threadpool(self._refuse_taken, key, rollout_id)
        named = self.remote_run(key, run)
        new = None
        if named is not None:
            run_id, where = named
            model = (self.settings.gateway_upstream_model or body.model) \
                if self.has_upstream else None
            new = NewEpisode(run_id=run_id, group_id=group, messages=messages,
                             tools=body.tools or [], model=model, where=where)
        elif await run_in_threadpool(queries.episode_run, self.store, rollout_id) is None:
            raise ApiError(404, "not_found", f"no rollout {rollout_id[:60]!r}, and no run to "
                           "create it in: name one with the X-Trajstore-Run header (or call "
                           "/v1/runs/{run}/episodes/{rollout_id}/chat/completions), use a key "
                           "scoped to a run, or set TRAJSTORE_REMOTE_DEFAULT_RUN",
                           field="header.X-Trajstore-Run")
        try:
            target = await self._target(key, rollout_id, new)
        except ApiError as exc:
            if exc.status == 403:  # a concurrent first call of another project won
                await run_in_threadpool(self._refuse_taken, key, rollout_id)
            raise
        assert target is not None
        return target

    async def _remote_generate(self, prompt: list[int], sampling: SamplingParams
                               ) -> tuple[list[int], list[float], str, str, str]:
        if not self.has_upstream:
            result = await self._generate(GenerationRequest(sampling=sampling,
                                                            prompt_ids=tuple(prompt)))
            return (result.response_ids.tolist(), result.logprobs.tolist(), result.text,
                    result.finish_reason, self.engine().name)
        upstream = self.upstream()
        body: dict[str, Any] = {"model": upstream.model or self.settings.gateway_model_name,
                                "prompt": prompt, "skip_special_tokens": True,
                                **{k: v for k, v in sampling.to_dict().items()
                                   if v is not None and v != []}}
        answer = await upstream.post("/completions", upstream.prepare(body, chat=False))
        if answer.status_code >= 400:
            raise ApiError(502 if answer.status_code >= 500 else answer.status_code,
                           "upstream_error", f"the upstream server answered "
                           f"{answer.status_code}: {answer.text[:500]}")
        try:
            data = answer.json()
            captured = captured_completion(data)
        except (ValueError, IncompleteAnswer) as exc:
            raise ApiError(502, "upstream_incomplete", str(exc)) from None
        if captured.prompt_ids != prompt:
            raise ApiError(502, "upstream_incomplete", "the upstream server reports other "
                           "prompt ids than the ones sent")
        return (captured.response_ids, captured.logprobs, captured.message["content"],
                captured.finish_reason or "stop", str(data.get("model") or ""))
