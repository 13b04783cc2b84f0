"""The episode a gateway call belongs to, and recording the call as an ``llm_called``.

The episode must exist and not be finished: a call recorded after ``episode_finished`` would
make the episode impossible to replay. A call that names its run (``NewEpisode``) creates the
episode on first use (the gateway when the call is recorded: ``planned_target``, so a refused
call creates nothing), and the run too when it does not exist yet (in the key's project, with
the default configuration and the tokenizer the model name implies), the way Agent Lightning's
proxy creates rollouts from ids in the URL; ids created so are checked against the key's
project exactly as explicit creation is. What
never changes about an episode (its run, group, policy version, tools, the run's
configuration) is cached per process.
"""

from __future__ import annotations

import re
import threading
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from api.access import Access
from api.call_ids import call_event_id
from api.errors import ApiError
from api.gateway.openai_format import Captured
from api.keys import ApiKey
from store import errors as store_errors
from store import queries
from store.eventlog import (
    ANY,
    NO_STREAM,
    AppendResult,
    EventStore,
    ExpectedVersion,
    run_stream_id,
)
from store.events import EpisodeStarted, Event, LLMCalled, RunConfig, RunCreated

__all__ = ["Capture", "EpisodeTarget", "NewEpisode"]

_ID = re.compile(r"^[A-Za-z0-9_.:\-]{1,200}$")


@dataclass(frozen=True)
class NewEpisode:
    """What creates an episode on first use: its run (created too when missing), its GRPO
    group (default: the episode id), its task, and the call's messages, tools and model
    name. ``where`` names the run's source in errors (a header, an OTLP attribute)."""

    run_id: str
    group_id: str | None = None
    task_id: str | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)
    model: str | None = None
    where: str = "header.X-Trajstore-Run"


@dataclass(frozen=True)
class EpisodeTarget:
    """An episode calls are recorded into, with what the gateway needs of it."""

    episode_id: str
    run_id: str
    group_id: str
    policy_version: int
    config: RunConfig
    tools: list[dict[str, Any]] = field(default_factory=list)
    #: The episode (and run) this call would create, created on the first record only
    #: (``Capture.planned_target``): a call refused before then creates nothing.
    pending: NewEpisode | None = None
    key: ApiKey | None = None


class Capture:
    """Looks up target episodes and appends captured calls to them."""

    def __init__(self, store: EventStore, access: Access, *,
                 tokenizer_roots: tuple[str, ...] | None = None) -> None:
        """``tokenizer_roots``: the folders a model name that is a folder must lie under to
        become a new run's tokenizer (``workers.engines.tokenizers.allowed_roots``); None
        when model names are the server's own (the in-process engine's folder)."""
        self.store = store
        self.access = access
        self.tokenizer_roots = tokenizer_roots
        self._targets: OrderedDict[str, EpisodeTarget] = OrderedDict()
        self._lock = threading.Lock()

    def target(self, key: ApiKey, episode_id: str) -> EpisodeTarget:
        """The episode ``episode_id`` if ``key`` may record into it. ApiError 404 for an
        unknown episode, 403 for another project's, 409 for a finished one."""
        if not episode_id or len(episode_id) > 200:
            raise ApiError(422, "invalid_request", f"episode id {episode_id[:60]!r} must be "
                           "1 to 200 characters", field="header.X-Trajstore-Episode")
        self.access.check_episode(key, episode_id)
        with self._lock:
            found = self._targets.get(episode_id)
        if found is None:
            found = self._load(episode_id)
            with self._lock:
                self._targets[episode_id] = found
                while len(self._targets) > 10_000:
                    self._targets.popitem(last=False)
        if queries.episode_finished(self.store, episode_id):
            raise ApiError(409, "episode_finished",
                           f"episode {episode_id!r} is finished; calls can no longer be "
                           "recorded into it")
        return found

    def target_or_create(self, key: ApiKey, episode_id: str, new: NewEpisode | None
                         ) -> EpisodeTarget:
        """``target``; when the episode does not exist and ``new`` names a run, the episode
        is created first (and the run, when missing: module docstring). ApiError 422 for a
        malformed id, 403 for a run of another project, 409 for a finished episode."""
        if new is None or queries.episode_run(self.store, episode_id) is not None:
            return self.target(key, episode_id)
        _check_ids(episode_id, new)
        if queries.run_record(self.store, new.run_id) is None:
            self._create_run(key, new)
        self.access.check_run(key, new.run_id)
        started = EpisodeStarted(run_id=new.run_id, group_id=new.group_id or episode_id,
                                 task_id=new.task_id, messages=new.messages, tools=new.tools)
        try:
            self.store.append(episode_id, [started], NO_STREAM)
        except store_errors.ConflictError:
            pass  # a concurrent first call created it: record into it
        return self.target(key, episode_id)

    def planned_target(self, key: ApiKey, episode_id: str, new: NewEpisode | None
                       ) -> EpisodeTarget:
        """``target_or_create`` without writing: for an episode that does not exist yet, the
        ids and the run's project are checked now (the same ApiErrors) and the target
        returned carries what creates it, which ``record`` does before the call is appended.
        A call refused after this (bad input, an engine error, an upstream failure)
        therefore leaves no run and no episode behind."""
        if new is None or queries.episode_run(self.store, episode_id) is not None:
            return self.target(key, episode_id)
        _check_ids(episode_id, new)
        config = self._new_run_config(new)  # the run's own, when it exists
        if queries.run_record(self.store, new.run_id) is not None:
            self.access.check_run(key, new.run_id)
            run = self.store.read_stream(run_stream_id(new.run_id), to_version=1)
            if run and isinstance(run[0].event, RunCreated):
                config = run[0].event.config
        return EpisodeTarget(episode_id=episode_id, run_id=new.run_id,
                             group_id=new.group_id or episode_id, policy_version=0,
                             config=config, tools=list(new.tools), pending=new, key=key)

    def _created(self, target: EpisodeTarget) -> EpisodeTarget:
        """``target`` with its episode (and run) created when it is pending; otherwise as
        is."""
        if target.pending is None or target.key is None:
            return target
        return self.target_or_create(target.key, target.episode_id, target.pending)

    def _new_run_config(self, new: NewEpisode) -> RunConfig:
        """The configuration a run created by a call takes (module docstring)."""
        from workers.engines.tokenizers import canonical_tokenizer, tokenizer_problem

        tokenizer = None
        if new.model and tokenizer_problem(new.model, roots=self.tokenizer_roots) is None:
            tokenizer = canonical_tokenizer(new.model)
        return RunConfig(tokenizer=tokenizer)

    def _create_run(self, key: ApiKey, new: NewEpisode) -> None:
        event = RunCreated(run_id=new.run_id, project=key.project,
                           config=self._new_run_config(new))
        try:
            self.store.append(run_stream_id(new.run_id), [event], NO_STREAM)
        except store_errors.ConflictError:
            pass  # created meanwhile; its project is checked by the caller

    def _load(self, episode_id: str) -> EpisodeTarget:
        first = self.store.read_stream(episode_id, to_version=1)
        if not first or not isinstance(first[0].event, EpisodeStarted):
            raise ApiError(404, "not_found", f"no episode {episode_id!r}")
        started = first[0].event
        run = self.store.read_stream(run_stream_id(started.run_id), to_version=1)
        config = run[0].event.config if run and isinstance(run[0].event, RunCreated) \
            else RunConfig()
        return EpisodeTarget(episode_id=episode_id, run_id=started.run_id,
                             group_id=started.group_id, policy_version=started.policy_version,
                             config=config, tools=list(started.tools))

    def record(self, target: EpisodeTarget, captured: Captured, *, agent: str, call_id: str,
               messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               latency_ms: float, policy_version: int | None = None,
               mask_check: dict[str, Any] | None = None,
               expected_version: ExpectedVersion = ANY,
               facts: Sequence[Event] = ()) -> AppendResult:
        """Append the call as an ``llm_called`` of ``agent``, after those of ``facts`` (events
        with derived ids: ``api.gateway.tool_facts``) the episode does not hold yet, in one
        append. Store errors propagate (validation of token ids and logprobs, a conflict
        under ``expected_version``).

        ``call_id`` is the id of the answer the client gets, and the event's id derives from
        it (``api.call_ids``), so an OTLP span of the same call is recognised when it comes.
        When the span came first (the log holds an ``llm_called`` from a span under that id),
        the call is not stored a second time: only the facts are appended. An id the log
        holds for anything else (an upstream server that reuses answer ids) gives the call
        a fresh event id. A pending target (``planned_target``) is created first; an
        ``expected_version`` that says the episode did not exist yet (0 or NO_STREAM, as the
        caller saw it before the creation) then means the version the creation left (its
        ``episode_started``), so a first call is not refused for the episode it opened."""
        if target.pending is not None and expected_version in (0, NO_STREAM):
            expected_version = 1
        target = self._created(target)
        response = dict(captured.message)
        if mask_check is not None:
            response["mask_check"] = mask_check
        event_id = call_event_id(call_id)
        seen = queries.span_call_stored(self.store, event_id)
        if seen:
            return self._facts_only(target, facts, expected_version)
        if seen is not None:
            event_id = uuid.uuid4()
        event = LLMCalled(
            event_id=event_id, agent=agent, call_id=call_id, messages=messages,
            tools=tools or None, prompt_ids=np.asarray(captured.prompt_ids, dtype=np.int64),
            response_ids=np.asarray(captured.response_ids, dtype=np.int64),
            logprobs=np.asarray(captured.logprobs, dtype=np.float64),
            response=response, finish_reason=captured.finish_reason,
            policy_version=target.policy_version if policy_version is None else policy_version,
            latency_ms=latency_ms, usage=captured.usage)
        try:
            pending = self._unstored(facts)
            while pending:
                try:
                    return self.store.append(target.episode_id, [*pending, event],
                                             expected_version)
                except (store_errors.ValidationError, store_errors.IdempotencyError):
                    # A concurrent call of the same history may have stored some facts first.
                    left = self._unstored(pending)
                    if len(left) == len(pending):
                        raise
                    pending = left
            return self.store.append(target.episode_id, [event], expected_version)
        except (store_errors.IdempotencyError, store_errors.ValidationError):
            # The call's span may have been stored between the look above and this append.
            if not queries.span_call_stored(self.store, event_id):
                raise
            return self._facts_only(target, facts, expected_version)

    def _facts_only(self, target: EpisodeTarget, facts: Sequence[Event],
                    expected_version: ExpectedVersion) -> AppendResult:
        """The facts of a call whose span was recorded first: appended when new, the call
        itself not again."""
        pending = self._unstored(facts)
        if pending:
            return self.store.append(target.episode_id, pending, expected_version)
        return AppendResult(stream_id=target.episode_id, positions=(),
                            version=self.store.stream_version(target.episode_id),
                            duplicate=True)

    def _unstored(self, facts: Sequence[Event]) -> list[Event]:
        if not facts:
            return []
        # Derived ids name their episode: looking them up in the whole log is exact.
        stored = queries.stored_event_ids(self.store,
                                          [e.event_id for e in facts if e.event_id])
        return [e for e in facts if e.event_id not in stored]


def _check_ids(episode_id: str, new: NewEpisode) -> None:
    """ApiError 422 naming the header (or ``new.where``) whose id is malformed."""
    for value, where in ((episode_id, "header.X-Trajstore-Episode"),
                         (new.run_id, new.where),
                         (new.group_id or episode_id, "header.X-Trajstore-Group")):
        if not _ID.match(value):
            raise ApiError(422, "invalid_request", f"{value[:60]!r} is not an id: 1 to "
                           "200 letters, digits or _.:-", field=where)
