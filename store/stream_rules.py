"""Where events may go: the rules every append path checks under the stream's lock.

- Optimistic concurrency: an append names the version it expects the stream to be at
  (``ANY``: no check; ``NO_STREAM`` or 0: the stream must not exist yet).
- A finished episode is closed (:func:`check_closed`, the one place of that rule) to all but
  a late ``reward_assigned`` (:func:`rewards_only`); the recorder then checks the episode's
  samples under their locks.
- ``episode_started`` only opens an episode, ``episode_finished`` ends its batch, and runs'
  streams (``run-<run id>``) hold a run's own events and nothing else.

Plain functions over the events and what the stream held when its lock was granted
(:class:`StreamState`); no database here. ``store.recorder`` reads the state (one SQL
fragment, ``_STATE_COLUMNS``, for all of its append paths) and calls :func:`check_append`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from store import errors
from store.events import (
    MAX_INT,
    EpisodeFinished,
    EpisodeStarted,
    Event,
    RewardAssigned,
    RunCreated,
)

__all__ = [
    "ANY",
    "NO_STREAM",
    "RUN_EVENTS",
    "ExpectedVersion",
    "StreamState",
    "check_append",
    "check_closed",
    "check_expected_version",
    "rewards_only",
    "run_stream_id",
]

ANY: Literal["any"] = "any"
NO_STREAM: Literal["no_stream"] = "no_stream"
ExpectedVersion = int | Literal["any", "no_stream"]

#: The event types of a run's own stream; every other type goes to an episode's stream.
RUN_EVENTS = ("run_created", "policy_updated", "policy_served")


def run_stream_id(run_id: str) -> str:
    """The stream that holds a run's own events (``run_created``, ``policy_updated``)."""
    return f"run-{run_id}"


@dataclass(frozen=True, slots=True)
class StreamState:
    """What the rules know of a stream: its ``version`` (0 when it does not exist) and
    whether it holds an ``episode_finished``, as read under the append's lock. A fact a rule
    comes to need is a field here and a column of ``store.recorder._STATE_COLUMNS``."""

    version: int
    finished: bool


def check_expected_version(value: object) -> int | None:
    """The version an append expects as a number (None for ``ANY``, 0 for ``NO_STREAM``).
    Raises ValidationError (field ``expected_version``) for anything else than an integer
    from 0 to 2**31 - 1, ``"any"`` or ``"no_stream"``."""
    if value == ANY:
        return None
    if value == NO_STREAM:
        return 0
    if (isinstance(value, bool) or not isinstance(value, int) or value < 0
            or value > MAX_INT):
        raise errors.ValidationError(
            f"expected_version must be an integer from 0 to {MAX_INT}, 'any' or 'no_stream', "
            f"got {value!r:.60}",
            field="expected_version",
        )
    return value


def rewards_only(events: Sequence[Event]) -> bool:
    """Whether a batch holds only ``reward_assigned`` events: what a finished episode takes."""
    return bool(events) and all(isinstance(e, RewardAssigned) for e in events)


def check_closed(stream_id: str, events: Sequence[Event], state: StreamState) -> None:
    """The closed-stream rule: nothing but a late reward may follow an episode's
    ``episode_finished``. Raises ``ClosedError`` (a ``ConflictError``) otherwise.

    A finished episode is closed: an event after its finish would change what replay made of
    it. A batch of rewards alone is the one exception (graders that score after the episode,
    the asynchronous remote-rollout revision); the recorder takes it only while none of the
    episode's samples is consumed or leased (``store.recorder.hold_samples_for_reward``).
    (A retry of the finishing batch is answered as an idempotent retry before any rule is
    asked.)"""
    if state.finished and not rewards_only(events):
        raise errors.ClosedError(stream_id, actual=state.version)


def check_append(stream_id: str, events: Sequence[Event], state: StreamState,
                 expected: int | None) -> None:
    """Whether ``events`` may follow a stream in ``state`` when the append expects version
    ``expected`` (None: any). Raises, in this order, ``ClosedError`` (:func:`check_closed`),
    ``ConflictError`` (the stream is at another version), ``ValidationError`` naming the
    event that goes where it may not (:func:`_check_order`) or ``NotFoundError`` (a reward
    for a stream that does not exist)."""
    check_closed(stream_id, events, state)
    if expected is not None and state.version != expected:
        raise errors.ConflictError(stream_id, expected=expected, actual=state.version)
    _check_order(stream_id, events, state.version)
    if state.version == 0 and isinstance(events[0], RewardAssigned):
        raise errors.NotFoundError(f"no episode {stream_id!r} to reward: a reward follows "
                                   "its episode's episode_started")


def _check_order(stream_id: str, events: Sequence[Event], current: int) -> None:
    """Where events may go: ``episode_started`` only as an episode's first event,
    ``episode_finished`` only last in its batch, and runs' streams (``run-<run id>``) apart
    from episodes' (only run events there, and a run's ``run_created`` only in its own
    stream), so that an episode cannot take the stream of a run that does not exist yet.
    ValidationError naming the event otherwise."""
    run_stream = stream_id.startswith("run-")
    for i, event in enumerate(events):
        if run_stream != (event.type in RUN_EVENTS):
            raise errors.ValidationError(
                f"{event.type} cannot go to stream {stream_id!r}: streams named 'run-…' hold "
                "a run's own events (run_created, policy_updated, policy_served) and nothing "
                "else",
                event_index=i, field="type")
        if isinstance(event, RunCreated) and stream_id != run_stream_id(event.run_id):
            raise errors.ValidationError(
                f"run {event.run_id!r} is created in its own stream "
                f"{run_stream_id(event.run_id)!r}, not {stream_id!r}", event_index=i,
                field="run_id")
        if isinstance(event, EpisodeStarted) and current + i != 0:
            raise errors.ValidationError(
                "episode_started may only be an episode's first event (stream version 1), "
                f"not version {current + i + 1}", event_index=i, field="type")
        if isinstance(event, EpisodeFinished) and i != len(events) - 1:
            raise errors.ValidationError(
                "episode_finished must be the last event of its episode; "
                f"{len(events) - 1 - i} event(s) follow it in this batch",
                event_index=i + 1, field="type")
