"""The agent loop: multi-turn tool calling with checkpoint/rollback, every step an event.

:func:`run_episode` plays one task against a generation backend and writes the episode's
events to a sink (stream id = episode id), in this order::

    episode_started
    llm_called                      (turn 1: prompt ids, response ids, logprobs, parsed message)
    checkpoint_created  turn_1      (before its tool calls run; retry_count so far)
    tool_returned …                 (one per call)
    ── when an output matches ``rollback_on_errors`` and rollback is enabled:
    attempt_failed                  (when ``save_negative_samples``; failed_call_id = that call)
    llm_called                      (regeneration; its request = context + failed turn + feedback)
    rolled_back                     (discarded_call_ids = [the failed call])
    checkpoint_created  turn_1      (retry_count + 1; the regenerated calls run) …
    ── otherwise the tool results join the context and the next turn is generated
    reward_assigned                 (none for a task scored elsewhere: ``unscored``)
    episode_finished

Semantics:

- A checkpoint is an event, never a copy of state. Checkpoint ``ckpt_<turn>_<retry>`` stands for
  the context *before* the assistant turn whose tool calls are about to run: rolling back to it
  discards that turn (its ``llm_called``, listed in ``discarded_call_ids``), its tool results and
  the error feedback; the regenerated turn takes the discarded turn's place in the context.
- Retries are counted per position ``turn_N`` (N = assistant turns kept so far; regenerations
  do not count as turns). Each failed attempt at a position increments its count; when the
  count exceeds ``max_tool_retries`` the episode ends ``terminated`` without another
  regeneration (so at most ``max_tool_retries`` regenerations per position, each of which gets
  its tool calls run).
- The whole turn rolls back when any of its outputs matches (see
  :mod:`workers.rollout.rollback`). Without a match, or with rollback disabled, tool results are
  appended as ``tool`` messages and the loop continues.
- A turn that tries to call a tool but does not parse (:mod:`workers.engines.toolcall`) runs no
  tool; it yields one ``tool_returned`` with name ``invalid_tool_call``, error type
  ``ToolCallFormatError`` and the "tool call format is wrong: …" text as output, which the
  default rollback patterns match. Without rollback that text is appended as a user message.
- Only the task's tools can be called; other names give ``ToolNotFoundError`` outcomes.
- Ends: ``completed`` (a turn without tool calls, or well-formed calls of a
  ``stop_at_tool_calls`` task), ``terminated`` (retries exhausted), ``truncated`` (``max_turns``
  reached with tool calls pending, a response cut at ``max_tokens``, or ``max_total_tokens``
  reached: each call's ``max_tokens`` is capped so that prompt + response fit in it, exactly
  when the loop renders the prompt (``prompt``) or the backend renders it and says how
  (:class:`~workers.engines.backend.PromptRenderer`), and otherwise by the room the previous
  call left), ``error`` (the backend, a tool
  registry or the reward raised: reward 0 with source "error", the exception text as reason).
- Prompts: with ``prompt`` (a :class:`~workers.engines.prompt.RunPrompt`, the run's tokenizer
  and chat template) the loop renders each request and gives the engine its token ids, so
  rollout renders as replay does; without it the backend renders ``messages`` itself.
- Sampling seeds: with ``sampling.seed`` set, the k-th call of the episode uses ``seed + k``.
- Writing: events are appended in order, one batch per LLM call (the events since the last
  call go to the sink as the next call starts, and the episode's last events as it ends), in
  the background: generation does not wait for the store. Before a tool that is not
  idempotent (:meth:`~workers.rollout.tools.ToolRegistry.idempotent`) runs, every event
  before it is stored (the call that asked for it, the checkpoint, the results before it).
  An append that fails stops the episode at its next step with that error (the episode
  cannot be recorded); the episode's result is returned only once every event is stored.
- Resume (``resume``: the stored events of an episode whose worker died): the episode is
  played again with the same arguments, and while stored events remain, each LLM call is
  taken from its ``llm_called`` (never generated again: the prompt ids the replay renders
  must equal the recorded ones, and the recorded response ids must decode to the recorded
  message), each tool result from its ``tool_returned`` (never run again), and every other
  event is checked against the stored one and not appended again; once they are used up the
  episode goes on with the engine and the tools, its events appended after the stored ones.
  In the last turn taken from the log, the first tool call without a stored result may have
  been running at the crash: it runs again when its tool is idempotent, and otherwise its
  result is a ``ToolInterruptedError`` error outcome, handled as any tool error (rollback
  patterns included). A log the replay does not reproduce (another policy version, other
  prompt ids, other events, events left over at the end) ends the episode ``error`` with the
  reason and no ``reward_assigned``, so it is never trained.
"""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
import json
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from store.arguments import whole_number
from store.events import (
    AttemptFailed,
    BranchedFrom,
    CheckpointCreated,
    EpisodeFinished,
    EpisodeStarted,
    Event,
    LLMCalled,
    RewardAssigned,
    RollbackConfig,
    RolledBack,
    RunConfig,
    ToolReturned,
)
from workers.engines.backend import (
    AsyncGenerationBackend,
    GenerationBackend,
    GenerationRequest,
    GenerationResult,
    PromptRenderer,
    SamplingParams,
)
from workers.engines.prompt import RunPrompt, decode_response
from workers.engines.toolcall import ParsedResponse, parse_response
from workers.rollout.agent_tasks import Task
from workers.rollout.aio import append_async, generate_async, run_sync
from workers.rollout.rewards import Reward, Transcript
from workers.rollout.rollback import format_error_feedback, matches_rollback, rollback_config
from workers.rollout.sink import EventSink
from workers.rollout.tool_runner import ToolRunner, default_tool_runner
from workers.rollout.tools import TOOL_NOT_FOUND_ERROR, ToolOutcome, ToolRegistry

__all__ = [
    "FORMAT_ERROR_TOOL_NAME",
    "FORMAT_ERROR_TYPE",
    "INTERRUPTED_TOOL_ERROR",
    "EpisodeResult",
    "arun_episode",
    "run_episode",
]

FORMAT_ERROR_TOOL_NAME = "invalid_tool_call"
FORMAT_ERROR_TYPE = "ToolCallFormatError"
#: Error type of the result of a non-idempotent tool call that was running when the worker
#: playing the episode died (its result is unknown; it is not run again).
INTERRUPTED_TOOL_ERROR = "ToolInterruptedError"


@dataclass(frozen=True)
class EpisodeResult:
    """Summary of a played episode (the events in the sink are the full record). ``reward``
    is None for a task scored elsewhere (``unscored``): none was recorded."""

    episode_id: str
    status: str
    reason: str | None
    reward: Reward | None
    messages: tuple[dict[str, Any], ...]
    llm_calls: int
    tool_calls: int
    generated_tokens: int
    rollbacks: int


class _Generation(NamedTuple):
    call_id: str
    result: GenerationResult
    parsed: ParsedResponse
    recorded: bool = False  # taken from the log of a resumed episode


class ResumeError(Exception):
    """The stored events of a resumed episode are not what replaying it makes: the log
    cannot be continued (the episode ends ``error`` with this reason)."""


#: Fields that differ between two plays of the same step (times, ids).
_VOLATILE = frozenset({"event_id", "occurred_at", "latency_ms", "duration_ms"})


def _comparable(event: Event) -> Any:
    """``event``'s fields that a replay must reproduce, as plain JSON data."""
    data = event.model_dump(exclude=set(_VOLATILE))
    return json.loads(json.dumps(data, default=str))


class _SinkFailure(Exception):
    """The sink refused events: the episode cannot be recorded, so it is not finished."""

    def __init__(self, original: Exception) -> None:
        super().__init__(str(original))
        self.original = original


EpisodeStatus = Literal["completed", "terminated", "truncated", "error", "aborted"]
_Verdict = tuple[EpisodeStatus, str | None]


class _Episode:
    """State of one episode while it is played; see :func:`run_episode`."""

    def __init__(self, *, task: Task, backend: GenerationBackend | AsyncGenerationBackend,
                 tools: ToolRegistry, sink: EventSink, run_id: str, group_id: str, episode_id: str,
                 sampling: SamplingParams, rollback: RollbackConfig, max_turns: int,
                 max_total_tokens: int, agent: str, policy_version: int,
                 tool_runner: ToolRunner, prompt: RunPrompt | None,
                 gate: asyncio.Semaphore | None,
                 branched_from: BranchedFrom | None = None,
                 resume: Sequence[Event] = (),
                 call_guard: Callable[[], AbstractAsyncContextManager[None]] | None = None,
                 last_turn_tools: bool = False) -> None:
        self.call_guard = call_guard
        self.task, self.backend, self.tools, self.sink = task, backend, tools, sink
        self.gate = gate
        self.prompt = prompt
        self.branched_from = branched_from
        self.run_id, self.group_id, self.episode_id = run_id, group_id, episode_id
        self.sampling, self.rollback, self.agent = sampling, rollback, agent
        self.max_turns = task.max_turns if task.max_turns is not None else max_turns
        self.max_total_tokens = max_total_tokens
        self.last_turn_tools = last_turn_tools
        self.policy_version = policy_version
        self.tool_runner = tool_runner
        self.offered = {schema["function"]["name"] for schema in task.tools}
        self.context: list[dict[str, Any]] = [dict(m) for m in task.messages]
        self.kept_texts: list[str] = []
        self.retries: dict[str, int] = {}
        self.calls = self.tool_calls = self.generated = self.rollbacks = 0
        self.last_total = 0
        self.buffer: list[Event] = []
        self.writing: asyncio.Future[None] | None = None
        # The stored events of a resumed episode not yet replayed (module docstring).
        self.recorded: collections.deque[Event] = collections.deque(resume)
        self.replayed = 0

    # --- events ---------------------------------------------------------------------------

    async def emit(self, *events: Event) -> None:
        """Queue ``events``; they are appended, in order, at the next :meth:`flush`. While a
        resumed episode replays its stored events, each is checked against the next stored
        one instead (ResumeError when they differ) and not appended again."""
        self.check_writes()
        for event in events:
            if self.recorded:
                self.match_recorded(event)
            else:
                self.buffer.append(event)

    def cannot_resume(self, reason: str) -> ResumeError:
        """Stop replaying (what follows is appended after the stored events) and return the
        error that ends the episode."""
        self.recorded.clear()
        return ResumeError(f"the stored episode cannot be continued: {reason}")

    def match_recorded(self, event: Event) -> None:
        stored = self.recorded.popleft()
        self.replayed += 1
        if type(stored) is not type(event):
            raise self.cannot_resume(f"event {self.replayed} is {stored.type} in the log "
                                     f"but {event.type} in the replay")
        if (isinstance(stored, EpisodeStarted) and isinstance(event, EpisodeStarted)
                and stored.policy_version != event.policy_version):
            raise self.cannot_resume(f"it was played at policy version {stored.policy_version}"
                                     f" and this worker serves {event.policy_version}")
        if _comparable(stored) != _comparable(event):
            raise self.cannot_resume(f"event {self.replayed} ({stored.type}) differs from "
                                     f"the replay's")

    def recorded_generation(self, ids: tuple[int, ...] | None) -> _Generation:
        """The next LLM call of a resumed episode, from its stored ``llm_called``: the prompt
        the replay renders must be the recorded one (ResumeError otherwise)."""
        stored = self.recorded[0]
        call_id = f"call_{self.calls + 1}"
        if not isinstance(stored, LLMCalled):
            raise self.cannot_resume(f"the log holds {stored.type} where the replay makes "
                                     f"LLM call {call_id}")
        if stored.call_id != call_id:
            raise self.cannot_resume(f"the log holds LLM call {stored.call_id!r} where the "
                                     f"replay makes {call_id}")
        if ids is not None and [int(i) for i in stored.prompt_ids] != list(ids):
            raise self.cannot_resume(f"the prompt ids of {call_id} differ from the recorded "
                                     f"ones")
        tokenizer = (self.prompt.tokenizer if self.prompt is not None
                     else getattr(self.backend, "tokenizer", None))
        if tokenizer is None:
            raise self.cannot_resume("no tokenizer here decodes the recorded responses")
        text, _ = decode_response(tokenizer, [int(i) for i in stored.response_ids],
                                  stop=self.sampling.stop)
        parsed = parse_response(text, call_id=call_id)
        if (json.loads(json.dumps(parsed.to_message()))
                != json.loads(json.dumps(stored.response))):
            raise self.cannot_resume(f"the recorded response of {call_id} does not decode "
                                     f"to its recorded message")
        finish = stored.finish_reason
        if finish not in ("stop", "length", "tool_calls"):
            raise self.cannot_resume(f"{call_id} has finish reason {finish!r}")
        result = GenerationResult(
            prompt_ids=stored.prompt_ids, response_ids=stored.response_ids,
            logprobs=stored.logprobs, text=text,
            finish_reason="length" if finish == "length" else "stop",
            policy_version=stored.policy_version)
        self.recorded.popleft()
        self.replayed += 1
        return _Generation(call_id, result, parsed, recorded=True)

    def recorded_outcome(self, call_id: str, name: str) -> ToolOutcome | None:
        """The stored result of tool call ``call_id`` of a resumed episode (None when the
        log holds no more events); ResumeError when the log holds something else."""
        if not self.recorded:
            return None
        stored = self.recorded[0]
        if not (isinstance(stored, ToolReturned) and stored.tool_call_id == call_id
                and stored.name == name):
            raise self.cannot_resume(f"the log holds {stored.type} where the replay expects "
                                     f"the result of tool call {call_id!r} ({name})")
        return ToolOutcome(output=stored.output, is_error=stored.is_error,
                           error_type=stored.error_type, error_message=stored.error_message)

    def check_writes(self) -> None:
        """Raise the sink's failure as soon as an append in the background has failed."""
        writing = self.writing
        if writing is not None and writing.done() and not writing.cancelled():
            error = writing.exception()
            if isinstance(error, Exception):
                raise _SinkFailure(error)
            if error is not None:  # KeyboardInterrupt, SystemExit: not the sink's refusal
                raise error

    def flush(self) -> None:
        """Start appending the queued events as one batch, after the batches before it,
        without waiting for the sink: generation goes on while the store writes."""
        self.check_writes()
        if not self.buffer:
            return
        batch, self.buffer = self.buffer, []
        previous = self.writing

        async def write() -> None:
            if previous is not None:
                await previous  # in order; a failed batch stops the ones after it
            await append_async(self.sink, self.episode_id, batch)

        self.writing = asyncio.ensure_future(write())

    async def drain(self) -> None:
        """Append what is queued and wait until every batch is stored."""
        self.flush()
        if self.writing is not None:
            try:
                await self.writing
            except Exception as exc:
                raise _SinkFailure(exc) from exc

    def stamp(self) -> dict[str, Any]:
        return {"event_id": uuid.uuid4(), "occurred_at": dt.datetime.now(dt.UTC)}

    # --- steps ----------------------------------------------------------------------------

    async def generate(self, messages: list[dict[str, Any]]) -> _Generation | None:
        """One LLM call on ``messages``; None when no token budget is left."""
        request = GenerationRequest(sampling=self.sampling,
                                    messages=tuple(dict(m) for m in messages),
                                    tools=self.task.tools or None)
        ids: tuple[int, ...] | None = None
        if self.prompt is not None:  # the run's rendering, which replay expects
            ids = tuple(self.prompt.ids(request.messages or (), request.tools))
            used = len(ids)
        elif isinstance(self.backend, PromptRenderer):
            used = len(self.backend.prompt_ids(request))
        else:  # a lower bound: the previous call's prompt + response
            used = self.last_total
        room = self.max_total_tokens - used
        if room < 1:
            return None
        seed = None if self.sampling.seed is None else self.sampling.seed + self.calls
        params = self.sampling.replace(max_tokens=min(self.sampling.max_tokens, room),
                                       seed=seed)
        asked = request
        request = (GenerationRequest(sampling=params, prompt_ids=ids) if ids is not None
                   else GenerationRequest(sampling=params, messages=request.messages,
                                          tools=request.tools))
        if self.recorded:  # a resumed episode: the stored call, not a new one
            generation = self.recorded_generation(ids)
            self.calls += 1
            result = generation.result
            self.last_total = int(result.prompt_ids.shape[0] + result.response_ids.shape[0])
            self.generated += int(result.response_ids.shape[0])
            return generation
        self.flush()  # what happened so far is on its way to the store meanwhile
        started = time.perf_counter()
        if self.call_guard is not None:  # e.g. take up a newer policy (continue_across_updates)
            async with self.call_guard():
                started = time.perf_counter()
                result = await generate_async(self.backend, request)
        else:
            result = await generate_async(self.backend, request)
        latency_ms = (time.perf_counter() - started) * 1000.0
        self.calls += 1
        call_id = f"call_{self.calls}"
        parsed = parse_response(result.text, call_id=call_id)
        finish = ("tool_calls" if parsed.tool_calls and result.finish_reason == "stop"
                  else result.finish_reason)
        await self.emit(LLMCalled(
            **self.stamp(), agent=self.agent, call_id=call_id,
            messages=list(asked.messages or ()),
            tools=list(self.task.tools) or None, prompt_ids=result.prompt_ids,
            response_ids=result.response_ids, logprobs=result.logprobs,
            response=parsed.to_message(), finish_reason=finish,
            policy_version=result.policy_version, latency_ms=latency_ms,
            usage={"prompt_tokens": int(result.prompt_ids.shape[0]),
                   "completion_tokens": int(result.response_ids.shape[0])},
        ))
        self.last_total = int(result.prompt_ids.shape[0] + result.response_ids.shape[0])
        self.generated += int(result.response_ids.shape[0])
        return _Generation(call_id, result, parsed)

    def verdict(self, turn: int, generation: _Generation) -> _Verdict | None:
        """How the episode ends after ``generation`` (None: it goes on to the tools)."""
        if generation.result.finish_reason == "length":
            return "truncated", "the response reached max_tokens"
        if self.last_total >= self.max_total_tokens:
            return "truncated", f"max_total_tokens ({self.max_total_tokens}) reached"
        parsed = generation.parsed
        if not parsed.attempted_tool_call:
            return "completed", None
        if parsed.well_formed and self.task.stop_at_tool_calls:
            return "completed", "the tool calls are the answer"
        if parsed.well_formed and turn >= self.max_turns and not self.last_turn_tools:
            return "truncated", f"max_turns ({self.max_turns}) reached with tool calls pending"
        return None

    async def run_tools(self, generation: _Generation) -> list[tuple[dict[str, Any], ToolOutcome]]:
        """Run the turn's tool calls (or report its format errors) and emit the results."""
        parsed = generation.parsed
        if not parsed.well_formed:
            text = "\n".join(parsed.format_errors)
            outcome = ToolOutcome(output=text, is_error=True, error_type=FORMAT_ERROR_TYPE,
                                  error_message=text)
            call_id = f"{generation.call_id}-invalid"
            raw = "\n".join(parsed.malformed_calls)
            call: dict[str, Any] = {"id": call_id, "name": FORMAT_ERROR_TOOL_NAME,
                                    "arguments": {}, "raw": raw}
            await self.emit(ToolReturned(
                **self.stamp(), agent=self.agent, tool_call_id=call_id,
                name=FORMAT_ERROR_TOOL_NAME, arguments={"raw": raw}, output=text,
                is_error=True, error_type=FORMAT_ERROR_TYPE, error_message=text,
                duration_ms=0.0))
            return [(call, outcome)]
        results = []
        # In a turn taken from the log, the first call without a stored result may have been
        # running when the worker died (a non-idempotent tool runs only once what precedes
        # it is stored); the calls after it had not started.
        maybe_interrupted = generation.recorded
        for tool_call in parsed.tool_calls:
            started = time.perf_counter()
            outcome_or_none = self.recorded_outcome(tool_call.id, tool_call.name)
            if outcome_or_none is not None:
                outcome = outcome_or_none
            elif tool_call.name in self.offered:
                idempotent = self.tools.idempotent(tool_call.name)
                if maybe_interrupted and not idempotent:
                    outcome = ToolOutcome.error(
                        INTERRUPTED_TOOL_ERROR,
                        f"{tool_call.name} was interrupted: the worker running it stopped "
                        f"before its result was stored, and the tool is not idempotent, so "
                        f"it is not run again")
                else:
                    if not idempotent:
                        await self.drain()  # the call is stored before the tool runs
                    outcome = await self.tool_runner.call(self.tools, tool_call.name,
                                                          tool_call.arguments)
                maybe_interrupted = False
            else:
                outcome = ToolOutcome.error(
                    TOOL_NOT_FOUND_ERROR,
                    f"no tool named {tool_call.name!r}; available: {sorted(self.offered)}")
            duration_ms = (time.perf_counter() - started) * 1000.0
            self.tool_calls += 1
            call = {"id": tool_call.id, "name": tool_call.name,
                    "arguments": tool_call.arguments}
            results.append((call, outcome))
            await self.emit(ToolReturned(
                **self.stamp(), agent=self.agent, tool_call_id=tool_call.id, name=tool_call.name,
                arguments=tool_call.arguments, output=outcome.output, is_error=outcome.is_error,
                error_type=outcome.error_type, error_message=outcome.error_message,
                duration_ms=duration_ms))
        return results

    def append_results(self, generation: _Generation,
                       results: list[tuple[dict[str, Any], ToolOutcome]]) -> None:
        if not generation.parsed.well_formed:
            self.context.append({"role": "user", "content": results[0][1].output})
            return
        for call, outcome in results:
            self.context.append({"role": "tool", "tool_call_id": call["id"],
                                 "name": call["name"], "content": outcome.output})

    async def process_tools(self, turn: int, generation: _Generation) -> _Verdict | None:
        """Checkpoint, run tools, roll back and retry on matching errors (module docstring)."""
        key = f"turn_{turn}"
        while True:
            retry = self.retries.get(key, 0)
            checkpoint_id = f"ckpt_{turn}_{retry}"
            await self.emit(CheckpointCreated(**self.stamp(), agent=self.agent,
                                        checkpoint_id=checkpoint_id, position_key=key,
                                        retry_count=retry))
            results = await self.run_tools(generation)
            failing = [(call, outcome) for call, outcome in results
                       if matches_rollback(outcome, self.rollback.rollback_on_errors)]
            if not (self.rollback.enable_tool_rollback and failing):
                self.append_results(generation, results)
                return None
            self.retries[key] = retry + 1
            if self.rollback.save_negative_samples:
                await self.emit(AttemptFailed(
                    **self.stamp(), agent=self.agent, checkpoint_id=checkpoint_id,
                    position_key=key, retry_index=retry,
                    error_messages=[outcome.output for _, outcome in failing],
                    error_types=[outcome.error_type or "" for _, outcome in failing],
                    failed_tool_calls=[call for call, _ in failing],
                    failed_call_id=generation.call_id))
            if self.retries[key] > self.rollback.max_tool_retries:
                kinds = sorted({outcome.error_type or "error" for _, outcome in failing})
                return ("terminated", f"tool calls at {key} still failed after "
                        f"{self.rollback.max_tool_retries} retries ({', '.join(kinds)})")
            feedback = format_error_feedback([outcome.output for _, outcome in failing])
            regenerated = await self.generate(
                self.context + [{"role": "user", "content": feedback}])
            if regenerated is None:
                return "truncated", f"max_total_tokens ({self.max_total_tokens}) reached"
            await self.emit(RolledBack(**self.stamp(), agent=self.agent,
                                       checkpoint_id=checkpoint_id,
                                       discarded_call_ids=[generation.call_id]))
            self.rollbacks += 1
            self.context[-1] = regenerated.parsed.to_message()
            self.kept_texts[-1] = regenerated.result.text
            generation = regenerated
            verdict = self.verdict(turn, generation)
            if verdict is not None:
                return verdict

    async def play(self) -> _Verdict:
        turn = 0
        while True:
            if turn >= self.max_turns:
                return "truncated", f"max_turns ({self.max_turns}) reached"
            generation = await self.generate(self.context)
            if generation is None:
                return "truncated", f"max_total_tokens ({self.max_total_tokens}) reached"
            turn += 1
            self.context.append(generation.parsed.to_message())
            self.kept_texts.append(generation.result.text)
            verdict = self.verdict(turn, generation)
            if verdict is None:
                verdict = await self.process_tools(turn, generation)
            if verdict is not None:
                return verdict

    async def run(self) -> EpisodeResult:
        try:
            if self.gate is None:
                status, reason, reward = await self._play_to_end()
            else:
                # The gate bounds episodes that generate, run tools or score: one whose
                # last events are being stored no longer holds a place in it.
                async with self.gate:
                    status, reason, reward = await self._play_to_end()
            await self.drain()
        except _SinkFailure as failure:
            raise failure.original from None
        return EpisodeResult(
            episode_id=self.episode_id, status=status, reason=reason, reward=reward,
            messages=tuple(self.context), llm_calls=self.calls, tool_calls=self.tool_calls,
            generated_tokens=self.generated, rollbacks=self.rollbacks)

    async def _play_to_end(self) -> tuple[EpisodeStatus, str | None, Reward | None]:
        """Play the episode and queue its last events (written by :meth:`drain`)."""
        try:
            await self.emit(EpisodeStarted(
                **self.stamp(), run_id=self.run_id, group_id=self.group_id,
                task_id=self.task.task_id, messages=[dict(m) for m in self.task.messages],
                tools=[dict(t) for t in self.task.tools],
                sampling_params=self.sampling.to_dict(), policy_version=self.policy_version,
                branched_from=self.branched_from))
            status, reason = await self.play()
            if self.recorded:
                raise self.cannot_resume(f"the replay ends ({status}) with "
                                         f"{len(self.recorded)} stored events left")
            reward = self.task.score(Transcript(messages=tuple(self.context),
                                                assistant_texts=tuple(self.kept_texts),
                                                status=status))
        except _SinkFailure:
            raise
        except Exception as exc:  # recorded as the episode's end, not lost
            status = "error"
            reason = f"{type(exc).__name__}: {exc}"
            # A log that cannot be continued gets no reward: its samples are never leased.
            reward = None if isinstance(exc, ResumeError) else Reward(0.0, {}, source="error")
        if reward is not None:  # an unscored task records none: no reward is invented
            await self.emit(RewardAssigned(**self.stamp(), value=reward.value,
                                           components=reward.components,
                                           source=reward.source))
        await self.emit(EpisodeFinished(**self.stamp(), status=status, reason=reason))
        return status, reason, reward


def _episode(*, task: Task, backend: Any, tools: ToolRegistry, sink: Any, run_id: str,
             sampling: SamplingParams | None, rollback: Any, group_id: str | None,
             episode_id: str | None, max_turns: int, max_total_tokens: int, agent: str,
             policy_version: int | None, tool_runner: ToolRunner | None,
             prompt: RunPrompt | None, gate: asyncio.Semaphore | None = None,
             branched_from: BranchedFrom | Mapping[str, Any] | None = None,
             resume: Sequence[Event] | None = None,
             call_guard: Callable[[], AbstractAsyncContextManager[None]] | None = None,
             last_turn_tools: bool = False) -> _Episode:
    """Check the arguments of :func:`run_episode`/:func:`arun_episode` and build the state."""
    if not isinstance(task, Task):
        raise TypeError(f"task must be a Task, got {type(task).__name__}")
    if not isinstance(backend, (GenerationBackend, AsyncGenerationBackend)):
        raise TypeError(f"backend must have a generate(request) method, "
                        f"got {type(backend).__name__}")
    if not isinstance(tools, ToolRegistry):
        raise TypeError(f"tools must be a ToolRegistry, got {type(tools).__name__}")
    if not isinstance(sink, EventSink):
        raise TypeError(f"sink must have an append(stream_id, events) method, "
                        f"got {type(sink).__name__}")
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"run_id must be a non-empty string, got {run_id!r}")
    for name, value in (("max_turns", max_turns), ("max_total_tokens", max_total_tokens)):
        whole_number(name, value)
    if sampling is None:
        sampling = SamplingParams()
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
    if tool_runner is not None and not isinstance(tool_runner, ToolRunner):
        raise TypeError(f"tool_runner must be a ToolRunner, got {type(tool_runner).__name__}")
    if prompt is not None and not isinstance(prompt, RunPrompt):
        raise TypeError(f"prompt must be a RunPrompt, got {type(prompt).__name__}")
    if call_guard is not None and not callable(call_guard):
        raise TypeError(f"call_guard must make async context managers, "
                        f"got {type(call_guard).__name__}")
    if gate is not None and not isinstance(gate, asyncio.Semaphore):
        raise TypeError(f"gate must be an asyncio.Semaphore, got {type(gate).__name__}")
    if policy_version is None:
        policy_version = int(getattr(backend, "policy_version", 0))
    if branched_from is not None and not isinstance(branched_from, BranchedFrom):
        branched_from = BranchedFrom.model_validate(branched_from)
    resume = list(resume) if resume is not None else []
    if resume and not isinstance(resume[0], EpisodeStarted):
        raise ValueError(f"resume must be an episode's stored events from its episode_started,"
                         f" got {type(resume[0]).__name__} first")
    if not all(isinstance(event, Event) for event in resume):
        raise TypeError("resume must hold events")
    if episode_id is None:
        episode_id = str(uuid.uuid4())
    if not isinstance(episode_id, str) or not episode_id:
        raise ValueError(f"episode_id must be a non-empty string, got {episode_id!r}")
    if group_id is None:
        group_id = f"{run_id}:{task.task_id}:v{policy_version}"
    return _Episode(task=task, backend=backend, tools=tools, sink=sink, run_id=run_id,
                    group_id=group_id, episode_id=episode_id, sampling=sampling,
                    rollback=rollback_config(rollback), max_turns=max_turns,
                    max_total_tokens=max_total_tokens, agent=agent,
                    policy_version=policy_version,
                    tool_runner=tool_runner if tool_runner is not None else default_tool_runner(),
                    prompt=prompt, gate=gate, branched_from=branched_from, resume=resume,
                    call_guard=call_guard, last_turn_tools=last_turn_tools)


async def arun_episode(
    *,
    task: Task,
    backend: GenerationBackend | AsyncGenerationBackend,
    tools: ToolRegistry,
    sink: EventSink,
    run_id: str,
    sampling: SamplingParams | None = None,
    rollback: RollbackConfig | RunConfig | Mapping[str, Any] | None = None,
    group_id: str | None = None,
    episode_id: str | None = None,
    max_turns: int = 8,
    max_total_tokens: int = 4096,
    agent: str = "main",
    policy_version: int | None = None,
    tool_runner: ToolRunner | None = None,
    prompt: RunPrompt | None = None,
    gate: asyncio.Semaphore | None = None,
    branched_from: BranchedFrom | Mapping[str, Any] | None = None,
    resume: Sequence[Event] | None = None,
    call_guard: Callable[[], AbstractAsyncContextManager[None]] | None = None,
    last_turn_tools: bool = False,
) -> EpisodeResult:
    """Play ``task`` with ``backend`` and ``tools``, appending its events to ``sink`` under
    ``episode_id`` (a new UUID string when None); see the module docstring for the event
    sequence and the rollback rules. This is the agent loop; many episodes run concurrently
    in one event loop and share one backend.

    The backend is awaited through ``agenerate`` when it has one (the batching backends:
    concurrent requests are generated together) and otherwise its ``generate`` runs in a
    thread, one request at a time. Appends run in a thread unless the sink has an
    ``aappend`` coroutine; tools run through ``tool_runner`` (default: the process's
    :func:`~workers.rollout.tool_runner.default_tool_runner`), so neither blocks the event loop.

    ``group_id`` is the GRPO group (default ``"<run_id>:<task_id>:v<policy_version>"``);
    ``policy_version`` defaults to the backend's ``policy_version`` attribute (0 without one);
    ``rollback`` accepts the run config, its rollback part, a dict of its fields or None for
    the defaults; ``task.max_turns`` overrides ``max_turns``; ``prompt`` renders requests
    for the engine (the run's tokenizer and template; None: the backend renders). ``gate``,
    when given, is held while the episode generates, runs tools and is scored, and released
    before the wait for its last events to be stored (a bound on the episodes that use the
    engine, not on those whose commit is pending). ``branched_from`` (an episode id and a
    turn, :mod:`workers.rollout.branch`) is recorded in ``episode_started``. Failures
    of the backend, tools, the template or the reward end the episode with status
    ``error``; failures of the sink propagate (the episode cannot be recorded). Invalid
    arguments raise ValueError/TypeError naming them.

    ``resume``, the stored events of an unfinished episode (from its ``episode_started``),
    continues it instead of starting it: the sink must already be at the end of those events
    (an :class:`~workers.rollout.episode_writer.EpisodeWriter` started at their number), the
    arguments must be those it was played with (same seed); see "Resume" in the module
    docstring.

    ``call_guard``, when given, makes an async context manager entered around each LLM call
    the episode generates (not one taken from a resumed log): the rollout worker of a run
    with ``rollout.continue_across_updates`` brings its engine to the run's newest policy on
    entering it (:meth:`~workers.rollout.runtime.WeightsGate.calling`), so an episode
    continues on a policy published while it plays; each ``llm_called``
    records the version and log-probs of the weights that generated it
    (``GenerationResult.policy_version``), ``episode_started`` the version it started on.

    ``last_turn_tools`` runs the tool calls of the turn that reaches ``max_turns`` (their
    results are recorded and join the context) before the episode ends ``truncated``, as the
    remote protocol's reference RolloutServer does; by default they are left pending.
    """
    episode = _episode(task=task, backend=backend, tools=tools, sink=sink, run_id=run_id,
                       sampling=sampling, rollback=rollback, group_id=group_id,
                       episode_id=episode_id, max_turns=max_turns,
                       max_total_tokens=max_total_tokens, agent=agent,
                       policy_version=policy_version, tool_runner=tool_runner,
                       prompt=prompt, gate=gate, branched_from=branched_from,
                       resume=resume, call_guard=call_guard,
                       last_turn_tools=last_turn_tools)
    return await episode.run()


def run_episode(
    *,
    task: Task,
    backend: GenerationBackend | AsyncGenerationBackend,
    tools: ToolRegistry,
    sink: EventSink,
    run_id: str,
    sampling: SamplingParams | None = None,
    rollback: RollbackConfig | RunConfig | Mapping[str, Any] | None = None,
    group_id: str | None = None,
    episode_id: str | None = None,
    max_turns: int = 8,
    max_total_tokens: int = 4096,
    agent: str = "main",
    policy_version: int | None = None,
    tool_runner: ToolRunner | None = None,
    prompt: RunPrompt | None = None,
    resume: Sequence[Event] | None = None,
    last_turn_tools: bool = False,
) -> EpisodeResult:
    """:func:`arun_episode` for callers without an event loop: plays the one episode to its
    end and returns its result (same arguments, same errors). Called from a thread that runs
    an event loop, it plays in a helper thread."""
    episode = _episode(task=task, backend=backend, tools=tools, sink=sink, run_id=run_id,
                       sampling=sampling, rollback=rollback, group_id=group_id,
                       episode_id=episode_id, max_turns=max_turns,
                       max_total_tokens=max_total_tokens, agent=agent,
                       policy_version=policy_version, tool_runner=tool_runner,
                       prompt=prompt, resume=resume, last_turn_tools=last_turn_tools)
    return run_sync(episode.run())
