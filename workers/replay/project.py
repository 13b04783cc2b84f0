"""Projecting one finished episode: read its events, replay them, write the projection.

``build_projection`` is pure (events + replay result in, projection rows out);
``project_episode`` does the I/O around it and is what the Celery task and the sweep call.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from store.eventlog import EventStore, RecordedEvent
from store.events import (
    AttemptFailed,
    CheckpointCreated,
    EpisodeFinished,
    EpisodeStarted,
    LLMCalled,
    RolledBack,
    RunCreated,
    ToolReturned,
)
from store.projections import (
    EpisodeProjection,
    EpisodeRow,
    FailureRow,
    ForkRow,
    Projections,
    RunRow,
    SampleRow,
    ToolCallRow,
)
from workers.replay.episode import ReplayResult, replay_episode
from workers.replay.errors import ReplayError
from workers.tokenizers import TokenizerNotFound, load_tokenizer

__all__ = ["ProjectOutcome", "build_projection", "project_episode", "run_row"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProjectOutcome:
    """What ``project_episode`` did: ``written`` (new rows), ``skipped`` (already projected
    at this version), ``unfinished`` (no episode_finished yet) or ``missing``."""

    episode_id: str
    outcome: str
    status: str | None = None
    reason: str | None = None


def run_row(recorded: RecordedEvent) -> RunRow:
    run = recorded.event
    assert isinstance(run, RunCreated)
    return RunRow(
        run_id=run.run_id,
        project=run.project,
        group_size=run.config.group_size,
        max_negatives_per_group=run.config.negatives.max_negative_samples_per_group,
        save_negative_samples=run.config.rollback.save_negative_samples,
        config=run.to_data()["config"],
        created_at=recorded.recorded_at,
    )


def _retry_outcome(
    events: Sequence[RecordedEvent], index: int, *, agent: str, checkpoint_id: str | None,
    position_key: str | None, status: str | None
) -> tuple[bool, int | None]:
    """Whether the failure at ``events[index]`` (an attempt under ``checkpoint_id``) was
    rolled back and retried, and, when the agent then passed its position (a checkpoint
    elsewhere, or the episode completed), how many retries that took from this failure: the
    rollbacks to checkpoints at that position that followed it."""
    if checkpoint_id is None or position_key is None:
        return False, None
    at_position = {
        r.event.checkpoint_id for r in events
        if isinstance(r.event, CheckpointCreated) and r.event.agent == agent
        and r.event.position_key == position_key
    }
    later = events[index + 1 :]
    rollbacks = [r.event for r in later if isinstance(r.event, RolledBack)
                 and r.event.agent == agent and r.event.checkpoint_id in at_position]
    retried = any(rb.checkpoint_id == checkpoint_id for rb in rollbacks)
    moved_on = any(
        isinstance(r.event, CheckpointCreated) and r.event.agent == agent
        and r.event.position_key != position_key for r in later
    )
    recovered = retried and (moved_on or status == "completed")
    return retried, len(rollbacks) if recovered else None


def _failures(
    events: Sequence[RecordedEvent], run_id: str, group_id: str, status: str | None
) -> list[FailureRow]:
    """One row per tool error and per failed attempt, with whether it was recovered: a tool
    error when a later call of the same tool by the same agent succeeded; a failed attempt
    when the agent later moved past that position (a checkpoint elsewhere) or the episode
    completed. ``retried`` and ``retries_to_recover`` say whether the attempt was rolled
    back and how many retries passing its position took (see ``_retry_outcome``)."""
    position: dict[str, tuple[str | None, int | None, str | None]] = {}
    policy: dict[str, int] = {}
    rows: list[tuple[int, FailureRow]] = []
    for i, r in enumerate(events):
        e = r.event
        if isinstance(e, LLMCalled):
            policy[e.agent] = e.policy_version
        elif isinstance(e, CheckpointCreated):
            position[e.agent] = (e.position_key, e.retry_count, e.checkpoint_id)
        elif isinstance(e, ToolReturned) and e.is_error:
            key, retry, checkpoint = position.get(e.agent, (None, None, None))
            recovered = any(
                isinstance(later.event, ToolReturned) and later.event.agent == e.agent
                and later.event.name == e.name and not later.event.is_error
                for later in events[i + 1 :]
            )
            retried, retries = _retry_outcome(events, i, agent=e.agent,
                                              checkpoint_id=checkpoint, position_key=key,
                                              status=status)
            rows.append((i, FailureRow(
                run_id=run_id, group_id=group_id, episode_id=r.stream_id, agent=e.agent,
                source="tool", stream_version=r.stream_version,
                policy_version=policy.get(e.agent), tool_name=e.name,
                error_type=e.error_type, error_message=e.error_message, position_key=key,
                retry_index=retry, recovered=recovered, occurred_at=e.occurred_at,
                retried=retried, retries_to_recover=retries)))
        elif isinstance(e, AttemptFailed):
            moved_on = any(
                isinstance(later.event, CheckpointCreated) and later.event.agent == e.agent
                and later.event.position_key != e.position_key
                for later in events[i + 1 :]
            )
            names = [c.get("name") or (c.get("function") or {}).get("name")
                     for c in e.failed_tool_calls]
            retried, retries = _retry_outcome(events, i, agent=e.agent,
                                              checkpoint_id=e.checkpoint_id,
                                              position_key=e.position_key, status=status)
            rows.append((i, FailureRow(
                run_id=run_id, group_id=group_id, episode_id=r.stream_id, agent=e.agent,
                source="attempt", stream_version=r.stream_version,
                policy_version=policy.get(e.agent),
                tool_name=next((n for n in names if n), None),
                error_type=e.error_types[0] if e.error_types else None,
                error_message=e.error_messages[0] if e.error_messages else None,
                position_key=e.position_key, retry_index=e.retry_index,
                recovered=moved_on or status == "completed", occurred_at=e.occurred_at,
                retried=retried, retries_to_recover=retries)))
    return [row for _, row in rows]


def _tool_calls(events: Sequence[RecordedEvent], run_id: str, group_id: str
                ) -> list[ToolCallRow]:
    """One row per ``tool_returned``, with the policy version of the agent's latest LLM call
    and the position of its latest checkpoint (as the failure rows have them)."""
    position: dict[str, str] = {}
    policy: dict[str, int] = {}
    rows: list[ToolCallRow] = []
    for r in events:
        e = r.event
        if isinstance(e, LLMCalled):
            policy[e.agent] = e.policy_version
        elif isinstance(e, CheckpointCreated):
            position[e.agent] = e.position_key
        elif isinstance(e, ToolReturned):
            rows.append(ToolCallRow(
                run_id=run_id, group_id=group_id, episode_id=r.stream_id, agent=e.agent,
                stream_version=r.stream_version, tool_name=e.name, is_error=e.is_error,
                policy_version=policy.get(e.agent), error_type=e.error_type,
                position_key=position.get(e.agent), duration_ms=e.duration_ms,
                occurred_at=e.occurred_at))
    return rows


def _as_mask(values: Sequence[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.uint8)


def build_projection(
    run: RunRow,
    events: Sequence[RecordedEvent],
    result: ReplayResult | None,
    *,
    invalid_reason: str | None = None,
) -> EpisodeProjection:
    """The rows of one episode. With ``result`` None the episode is ``invalid`` (its
    events could not be replayed) and only its summary and failures are written."""
    started = events[0].event
    assert isinstance(started, EpisodeStarted)
    episode_id = events[0].stream_id
    finished = next((r for r in reversed(events) if isinstance(r.event, EpisodeFinished)),
                    None)
    status = finished.event.status if isinstance(finished, RecordedEvent) and isinstance(
        finished.event, EpisodeFinished) else None
    calls = [r.event for r in events if isinstance(r.event, LLMCalled)]
    tools = [r.event for r in events if isinstance(r.event, ToolReturned)]
    policy_version = calls[-1].policy_version if calls else started.policy_version
    failures = _failures(events, started.run_id, started.group_id, status)
    tool_calls = _tool_calls(events, started.run_id, started.group_id)
    base: dict[str, Any] = dict(
        episode_id=episode_id, run_id=started.run_id, group_id=started.group_id,
        task_id=started.task_id, projected_version=events[-1].stream_version,
        policy_version=policy_version, llm_calls=len(calls), tool_calls=len(tools),
        tool_errors=sum(1 for t in tools if t.is_error),
        attempts_failed=sum(1 for r in events if isinstance(r.event, AttemptFailed)),
        rollbacks=sum(1 for r in events if isinstance(r.event, RolledBack)),
        tokens=sum(len(c.response_ids) for c in calls),
        started_at=events[0].recorded_at,
        finished_at=finished.recorded_at if finished else None,
    )
    if result is None:
        episode = EpisodeRow(status="invalid", invalid_reason=invalid_reason, **base)
        return EpisodeProjection(run=run, episode=episode, failures=failures,
                                 tool_calls=tool_calls)

    samples = [
        SampleRow(
            run_id=started.run_id, group_id=started.group_id, episode_id=episode_id,
            agent=s.agent, kind="positive", timeline_index=s.timeline_index,
            reward=result.reward, policy_version=policy_version,
            prompt_length=s.prompt_length, token_ids=np.asarray(s.token_ids, dtype=np.int32),
            loss_mask=_as_mask(s.loss_mask), logprobs=np.asarray(s.logprobs, dtype=np.float32),
            num_drifted=s.num_drifted_messages)
        for s in result.samples
        # An aborted episode (its worker died, or a redelivery replaced it) has no reward to
        # train on: its timelines are kept in the episode row's counts, not as samples.
        if status != "aborted"
    ]
    # Every failed attempt is kept as a negative candidate (when the run saves them); the
    # per-group cap is applied across the whole group when its samples are leased, since
    # "earliest failure first" needs every episode of the group.
    negatives = result.failures if run.save_negative_samples else []
    for n in negatives:
        s = n.sample
        samples.append(SampleRow(
            run_id=started.run_id, group_id=started.group_id, episode_id=episode_id,
            agent=s.agent, kind="negative", timeline_index=s.timeline_index,
            reward=s.reward, policy_version=policy_version, prompt_length=s.prompt_length,
            token_ids=np.asarray(s.token_ids, dtype=np.int32), loss_mask=_as_mask(s.loss_mask),
            logprobs=np.asarray(s.logprobs, dtype=np.float32),
            failed_at=n.occurred_at, failure_version=n.failure_index + 1,
            position_key=n.position_key, retry_index=n.retry_index,
            error_types=n.error_types, error_messages=n.error_messages))
    forks = [
        ForkRow(episode_id=episode_id, agent=f.agent, timeline=f.timeline_index,
                other=f.parent_index, message_index=f.message_index, reason=str(f.reason))
        for f in result.forks
    ]
    episode = EpisodeRow(
        status=status or "running", reward=result.reward, timelines=len(result.timelines),
        survivors=len(result.survivors), forks=len(forks),
        drifted_messages=result.drifted_messages, negatives=len(negatives), **base)
    return EpisodeProjection(run=run, episode=episode, samples=samples, forks=forks,
                             failures=failures, tool_calls=tool_calls)


def project_episode(
    store: EventStore,
    episode_id: str,
    *,
    tokenizer_loader: Callable[[str | None], Any] = load_tokenizer,
    before_commit: Callable[[], None] | None = None,
) -> ProjectOutcome:
    """Replay one episode from the log into the projections, idempotently.

    An episode not finished yet is left alone (``unfinished``); one already projected at its
    final version is ``skipped``. An episode whose events cannot be replayed (a prompt that is
    not a rendering of its messages, a tokenizer that cannot be found, a stream out of order)
    is written with status ``invalid`` and the reason: it never raises for bad data, so one
    bad episode cannot block a worker. Database errors propagate (the task retries transient
    ones). ``before_commit`` runs inside the write transaction, before commit (a
    fault-injection hook for tests).
    """
    events = store.read_stream(episode_id)
    if not events or not isinstance(events[0].event, EpisodeStarted):
        return ProjectOutcome(episode_id, "missing")
    if not any(isinstance(r.event, EpisodeFinished) for r in events):
        return ProjectOutcome(episode_id, "unfinished")
    projections = Projections(store)
    done = projections.projected_version(episode_id)
    if done is not None and done >= events[-1].stream_version:
        return ProjectOutcome(episode_id, "skipped")
    started = events[0].event
    assert isinstance(started, EpisodeStarted)
    run_events = store.read_stream(f"run-{started.run_id}", to_version=1)
    if not run_events or not isinstance(run_events[0].event, RunCreated):
        run = RunRow(run_id=started.run_id, project="default", group_size=1,
                     max_negatives_per_group=0, save_negative_samples=False, config={},
                     created_at=dt.datetime.now(dt.UTC))
        projection = build_projection(run, events, None,
                                      invalid_reason=f"run {started.run_id!r} has no run_created")
    else:
        run = run_row(run_events[0])
        config = run_events[0].event.config  # type: ignore[union-attr]
        try:
            tokenizer = tokenizer_loader(config.tokenizer or config.model)
            result = replay_episode([r.event for r in events], config=config,
                                    tokenizer=tokenizer, episode_id=episode_id)
            projection = build_projection(run, events, result)
        except (ReplayError, TokenizerNotFound) as exc:
            log.warning("episode %s is invalid: %s", episode_id, exc)
            projection = build_projection(run, events, None, invalid_reason=str(exc))
    written = projections.write(projection, before_commit=before_commit)
    return ProjectOutcome(episode_id, "written" if written else "skipped",
                          status=projection.episode.status,
                          reason=projection.episode.invalid_reason)
