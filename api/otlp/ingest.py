"""Storing an OTLP trace export: its spans' events appended to their episodes.

Everything that can be refused is checked before anything is written, so a refused request
stores nothing: the events of every episode are validated as the log validates a batch
(400 naming the span otherwise), and every episode and run the export names is checked
against the key's project (403 for another project's, as for any write). Then each episode
is opened the way the capture gateway opens one (``Capture.target_or_create``: the episode,
and its run when missing, are created on first use) and its new events are appended. Events
whose ids are stored already (spans sent before, or the capture gateway's record of the same
LLM call or tool call: ``api.call_ids``) are left out, so an export sent twice is stored
once, and a call seen by both doors is one fact. An episode that is finished refuses
further events: its spans are reported as rejected in the answer's ``partial_success``, the
rest of the export is stored.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from api.access import Access
from api.call_ids import same_tool_call
from api.errors import ApiError
from api.gateway.capture import Capture, NewEpisode
from api.keys import ApiKey
from api.otlp.decode import OtlpError, Span
from api.otlp.genai import A_EPISODE, A_GROUP, A_RUN, EpisodeSpans, episode_events
from store import errors as store_errors
from store import queries
from store.eventlog import ANY, EventStore
from store.events import ToolReturned
from store.settings import Settings
from store.validation import validate_batch

__all__ = ["ExportOutcome", "RUN_HEADER", "default_run", "store_spans"]

log = logging.getLogger(__name__)

RUN_HEADER = "X-Trajstore-Run"

# The ids the gateway accepts for episodes, runs and groups (``api.gateway.capture``).
_ID = re.compile(r"^[A-Za-z0-9_.:\-]{1,200}$")


@dataclass(frozen=True)
class ExportOutcome:
    """What an export stored: events appended, events already stored, episodes written to,
    spans rejected and why (the ``partial_success`` of the answer)."""

    appended: int = 0
    duplicates: int = 0
    episodes: int = 0
    rejected_spans: int = 0
    message: str = ""


def default_run(project: str) -> str:
    """The run of spans that name none (no ``trajstore.run_id``, no ``X-Trajstore-Run``):
    ``otlp-<project>``, one per project, created on first use."""
    return "otlp-" + re.sub(r"[^A-Za-z0-9_.:\-]", "_", project)[:195]


def _check_id(value: str, what: str, where: str) -> None:
    if not _ID.match(value):
        raise OtlpError(f"{what} {value[:60]!r} is not an id: 1 to 200 letters, digits or "
                        "_.:-", where=where)


def _plan_run(plan: EpisodeSpans, key: ApiKey, header_run: str | None) -> str:
    if plan.run_id is not None:
        _check_id(plan.run_id, f"run ({A_RUN})", plan.where)
        return plan.run_id
    if header_run:
        _check_id(header_run, "run", f"header.{RUN_HEADER}")
        return header_run
    return default_run(key.project)


def _separate_reissued_tool_calls(store: EventStore, plan: EpisodeSpans) -> None:
    """A tool call span under the id its episode and tool call id give, where the log holds
    another call under that id (a client that issued the tool call id again): the span's
    own id instead, so it is stored rather than left out as a duplicate. The same call
    reported by the gateway first stays one fact (``api.call_ids``)."""
    held = queries.stored_tool_calls(store, [e.event_id for e in plan.events
                                             if e.event_id in plan.own_ids])
    for i, event in enumerate(plan.events):
        if not isinstance(event, ToolReturned) or event.event_id not in held:
            continue
        if not same_tool_call(held[event.event_id], (event.name, event.arguments)):
            plan.events[i] = event.model_copy(
                update={"event_id": plan.own_ids[event.event_id]})  # type: ignore[index]


def _separate_foreign_ids(store: EventStore, plan: EpisodeSpans, project: str) -> None:
    """An event under an id shared with another door (an LLM call's answer id, a tool
    call's episode and tool call id) that the log holds in another project's run: the
    span's own id instead, so that the span is stored for this project and nothing about
    the other project's event is told (an answer id known in advance drops no span)."""
    foreign = queries.foreign_event_ids(store, [e.event_id for e in plan.events
                                                if e.event_id in plan.own_ids], project)
    for i, event in enumerate(plan.events):
        if event.event_id in foreign:
            plan.events[i] = event.model_copy(
                update={"event_id": plan.own_ids[event.event_id]})  # type: ignore[index]
            if event.event_id in plan.unversioned:
                plan.unversioned.add(plan.own_ids[event.event_id])  # type: ignore[index]


def store_spans(store: EventStore, settings: Settings, access: Access, capture: Capture,
                key: ApiKey, spans: list[Span], *, header_run: str | None = None
                ) -> ExportOutcome:
    """Store the events of ``spans`` for ``key`` (module docstring). Raises OtlpError (400)
    for spans that do not make valid events, ApiError 403 when an episode or run they name
    belongs to another project."""
    plans = episode_events(spans, project=key.project)
    runs: dict[str, str] = {}
    for plan in plans:
        _check_id(plan.episode_id, f"episode ({A_EPISODE}, gen_ai.conversation.id or the "
                  "trace id)", plan.where)
        if plan.episode_id.startswith("run-"):
            raise OtlpError(f"episode {plan.episode_id[:60]!r}: ids beginning with 'run-' "
                            "name runs' own streams", where=plan.where)
        if plan.group_id is not None:
            _check_id(plan.group_id, f"group ({A_GROUP})", plan.where)
        runs[plan.episode_id] = _plan_run(plan, key, header_run)
        try:
            validate_batch(plan.events, settings)
        except store_errors.ValidationError as exc:
            where = plan.wheres[exc.event_index] if exc.event_index is not None else plan.where
            field = f"{exc.field}: " if exc.field else ""
            raise OtlpError(f"its {plan.events[exc.event_index or 0].type} event is "
                            f"invalid: {field}{exc.reason}", where=where) from None
    # The project checks, all before the first write.
    for plan in plans:
        if queries.episode_run(store, plan.episode_id) is not None:
            access.check_episode(key, plan.episode_id)
        elif queries.run_record(store, runs[plan.episode_id]) is not None:
            access.check_run(key, runs[plan.episode_id])
    appended = duplicates = rejected = 0
    problems: list[str] = []
    written = 0
    for plan in plans:
        new = NewEpisode(run_id=runs[plan.episode_id], group_id=plan.group_id,
                         task_id=plan.task_id, messages=plan.messages, tools=plan.tools,
                         model=plan.model, where=f"attribute {A_RUN}")
        for attempt in range(3):
            _separate_reissued_tool_calls(store, plan)
            _separate_foreign_ids(store, plan, key.project)
            stored = queries.stored_event_ids(store, [e.event_id for e in plan.events
                                                      if e.event_id is not None])
            fresh = [e for e in plan.events if e.event_id not in stored]
            if not fresh:
                break
            try:
                target = capture.target_or_create(key, plan.episode_id, new)
                fresh = [e.model_copy(update={"policy_version": target.policy_version})
                         if e.event_id in plan.unversioned else e for e in fresh]
                store.append(plan.episode_id, fresh, ANY)
            except store_errors.ValidationError as exc:
                # The same spans, sent concurrently, were stored meanwhile (the log refuses
                # a batch mixing stored and new ids): look again.
                if exc.field == "event_id" and attempt < 2:
                    continue
                raise
            except (ApiError, store_errors.ClosedError, store_errors.IdempotencyError) as exc:
                if isinstance(exc, ApiError) and exc.status != 409:
                    raise
                # The same spans, sent concurrently, may have stored and closed the episode
                # meanwhile: only events still missing are rejected.
                stored = queries.stored_event_ids(store, [e.event_id for e in plan.events
                                                          if e.event_id is not None])
                missing = {w for e, w in zip(plan.events, plan.wheres, strict=True)
                           if e.event_id not in stored}
                if not missing:
                    break
                rejected += len(missing)
                problems.append(f"episode {plan.episode_id!r}: {exc}")
                log.info("OTLP spans of episode %s rejected: %s", plan.episode_id, exc)
                break
            appended += len(fresh)
            written += 1
            break
        duplicates += len(stored)
    message = "; ".join(problems)
    if len(message) > 2000:
        message = message[:2000] + "…"
    return ExportOutcome(appended=appended, duplicates=duplicates, episodes=written,
                         rejected_spans=rejected, message=message)
