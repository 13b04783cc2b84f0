"""Projecting one finished episode: read its events, replay them, write the projection.

``build_projection`` is pure (events + replay result in, projection rows out);
``project_episode`` does the I/O around it and is what the Celery task calls;
``project_episodes`` does the same for a batch of episodes (one read, one write transaction)
and is what the sweep and a rebuild call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from store import errors
from store.eventlog import EventStore, RecordedEvent
from store.events import (
    MAX_INT,
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
from store.streams import read_run_events, read_streams
from workers.engines.tokenizers import TokenizerNotFound, load_tokenizer
from workers.replay.episode import (
    ReplayResult,
    code_version,
    needs_tokenizer,
    replay_episode,
    untokenized_reason,
)
from workers.replay.errors import ReplayError

__all__ = ["BATCH", "ProjectOutcome", "build_projection", "fault_delay", "project_episode",
           "project_episodes",
           "run_row"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProjectOutcome:
    """What ``project_episode`` did: ``written`` (new rows), ``skipped`` (already projected
    at this version), ``unfinished`` (no episode_finished yet) or ``missing``. ``reason``:
    why an ``invalid`` episode is, or why LLM calls without token ids gave no samples."""

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
    # A mask holds 0 and 1: its bytes are the uint8 array (a third of asarray's time).
    return np.frombuffer(bytes(values), dtype=np.uint8)


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
        projected_by=code_version(),
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


def fault_delay(settings: Any) -> Callable[[], None] | None:
    """The ``before_commit`` of a replay under ``TRAJSTORE_FAULT_REPLAY_DELAY_S`` (tests hold
    each replay's transaction open that long): a sleep of it, or None when it is 0."""
    delay = float(settings.fault_replay_delay_s)
    return (lambda: time.sleep(delay)) if delay > 0 else None


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
    return project_episodes(store, [episode_id], tokenizer_loader=tokenizer_loader,
                            before_commit=before_commit)[0]


#: Episodes projected together: one read of their events, one write transaction.
BATCH = 50


def project_episodes(
    store: EventStore,
    episode_ids: Sequence[str],
    *,
    tokenizer_loader: Callable[[str | None], Any] = load_tokenizer,
    before_commit: Callable[[], None] | None = None,
) -> list[ProjectOutcome]:
    """``project_episode`` for several episodes at once, one outcome per id in order: their
    events are read with one query, their runs with another, and every projection to write
    goes into one transaction (``Projections.write_many``; each episode with its checkpoint,
    as alone). The sweep and a rebuild project this way. When that transaction fails for
    anything but a transient error, the episodes are written one by one, so that one episode
    the database refuses does not hold back the others (its error propagates). Automatic
    garbage collection is paused while the batch is projected (``collector_paused``)."""
    with collector_paused():
        return _project_episodes(store, episode_ids, tokenizer_loader, before_commit)


_pause_lock = threading.Lock()
_pausers = 0
_resume = False


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's automatic garbage collection off for the duration (reference counting
    still frees everything acyclic), back on afterwards if it was on; nestable and
    thread-safe.

    A batch of episodes allocates tens of thousands of containers (decoded events, messages,
    token lists) that all die by reference count once the batch is written. With the
    collector on, their allocations trigger collections that move them towards the oldest
    generation, and the full collections that follow traverse the whole process: in a worker
    that has imported transformers, several hundred thousand objects, about a quarter of a
    second each time. Measured with ``bench/replay.py``, that was a third of a batch's time.
    Cycles made during the batch (there are few) are collected by the next automatic
    collection after it."""
    global _pausers, _resume
    with _pause_lock:
        if _pausers == 0:
            _resume = gc.isenabled()
            gc.disable()
        _pausers += 1
    try:
        yield
    finally:
        with _pause_lock:
            _pausers -= 1
            if _pausers == 0 and _resume:
                gc.enable()


def _project_episodes(store: EventStore, episode_ids: Sequence[str],
                      tokenizer_loader: Callable[[str | None], Any],
                      before_commit: Callable[[], None] | None) -> list[ProjectOutcome]:
    ids = list(dict.fromkeys(episode_ids))
    outcomes: dict[str, ProjectOutcome] = {}
    projections = Projections(store)
    # One pooled connection for the three reads (each checkout costs a round trip).
    with store.db.connection() as conn:
        streams = read_streams(store, ids, conn=conn)
        done = projections.projected_versions(ids, conn=conn)
        finished: list[list[RecordedEvent]] = []
        for episode_id in ids:
            events = streams.get(episode_id, [])
            if not events or not isinstance(events[0].event, EpisodeStarted):
                outcomes[episode_id] = ProjectOutcome(episode_id, "missing")
            elif not any(isinstance(r.event, EpisodeFinished) for r in events):
                outcomes[episode_id] = ProjectOutcome(episode_id, "unfinished")
            else:
                finished.append(events)
        todo = []
        for events in finished:
            version = done.get(events[0].stream_id)
            if version is not None and version >= events[-1].stream_version:
                outcomes[events[0].stream_id] = ProjectOutcome(events[0].stream_id, "skipped")
            else:
                todo.append(events)
        run_ids = [_started(events).run_id for events in todo]
        runs = read_run_events(store, set(run_ids), conn=conn)
    tokenizers: dict[str | None, Any] = {}
    run_rows: dict[str, RunRow] = {}
    built = [_build(events, runs.get(run_id), tokenizer_loader, tokenizers, run_rows)
             for events, run_id in zip(todo, run_ids, strict=True)]
    written: list[bool] | None = None
    if len(built) > 1:
        try:
            written = projections.write_many(built, before_commit=before_commit)
        except errors.TransientError:
            raise
        except errors.StoreError:
            log.warning("writing %d projections together failed; writing them one by one",
                        len(built), exc_info=True)
    if written is None:
        written = []
        for i, projection in enumerate(built):
            ok, built[i] = _write_one(projections, projection, todo[i], before_commit)
            written.append(ok)
    for projection, ok in zip(built, written, strict=True):
        episode = projection.episode
        outcomes[episode.episode_id] = ProjectOutcome(
            episode.episode_id, "written" if ok else "skipped", status=episode.status,
            reason=episode.invalid_reason or _untokenized(episode))
    return [outcomes[episode_id] for episode_id in episode_ids]


def _write_one(projections: Projections, projection: EpisodeProjection,
               events: list[RecordedEvent], before_commit: Callable[[], None] | None
               ) -> tuple[bool, EpisodeProjection]:
    """Write one projection; rows the database refuses as data (a value out of its range)
    make the episode ``invalid`` with that reason instead, so that one bad episode never
    blocks the others. Raises ValidationError only when even that cannot be written."""
    try:
        return projections.write(projection, before_commit=before_commit), projection
    except errors.ValidationError as exc:
        reason = f"its projection cannot be stored: {exc}"
        log.warning("episode %s is invalid: %s", projection.episode.episode_id, reason)
        built = build_projection(projection.run, events, None, invalid_reason=reason)
        # Only the summary, with the values the database refused left out.
        episode = built.episode
        out_of_range: dict[str, Any] = {
            f.name: None for f in dataclasses.fields(episode)
            if _overflows(getattr(episode, f.name))}
        invalid = EpisodeProjection(run=built.run,
                                    episode=dataclasses.replace(episode, **out_of_range))
        return projections.write(invalid, before_commit=before_commit), invalid


def _overflows(value: object) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)
            and not -MAX_INT - 1 <= value <= MAX_INT)


def _untokenized(episode: EpisodeRow) -> str | None:
    """Why the episode's LLM calls without token ids gave no samples (each tokenized call
    gives one initial timeline), or None."""
    if episode.timelines is None or episode.llm_calls is None:
        return None
    return untokenized_reason(episode.llm_calls - episode.timelines, episode.timelines)


def _started(events: list[RecordedEvent]) -> EpisodeStarted:
    started = events[0].event
    assert isinstance(started, EpisodeStarted)
    return started


def _build(events: list[RecordedEvent], run_event: RecordedEvent | None,
           tokenizer_loader: Callable[[str | None], Any],
           tokenizers: dict[str | None, Any],
           run_rows: dict[str, RunRow] | None = None) -> EpisodeProjection:
    """The projection of one finished episode: replayed, or ``invalid`` with the reason.
    ``tokenizers`` and ``run_rows`` keep what episodes of one batch share."""
    started = events[0].event
    assert isinstance(started, EpisodeStarted)
    episode_id = events[0].stream_id
    if run_event is None or not isinstance(run_event.event, RunCreated):
        unknown = RunRow(run_id=started.run_id, project="default", group_size=1,
                         max_negatives_per_group=0, save_negative_samples=False, config={},
                         created_at=dt.datetime.now(dt.UTC))
        return build_projection(unknown, events, None,
                                invalid_reason=f"run {started.run_id!r} has no run_created")
    rows = run_rows if run_rows is not None else {}
    run = rows.get(started.run_id)
    if run is None:
        run = rows[started.run_id] = run_row(run_event)
    config = run_event.event.config
    plain = [r.event for r in events]
    try:
        tokenizer = None
        if needs_tokenizer(plain):  # calls recorded without token ids need none
            name = config.tokenizer_name
            if name not in tokenizers:
                tokenizers[name] = tokenizer_loader(name)
            tokenizer = tokenizers[name]
        result = replay_episode(plain, config=config, tokenizer=tokenizer,
                                episode_id=episode_id, owner=run.project)
        if result.untokenized_calls:
            log.info("episode %s: %s", episode_id, result.untokenized_reason)
        return build_projection(run, events, result)
    except (ReplayError, TokenizerNotFound) as exc:
        log.warning("episode %s is invalid: %s", episode_id, exc)
        return build_projection(run, events, None, invalid_reason=str(exc))
