"""Episodes: starting one, appending events, listing and reading them, their timelines."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from api.schemas.common import FloatArray, IntArray
from store.events import RewardNumber

__all__ = [
    "AppendRequest",
    "AppendResult",
    "BranchCreate",
    "BranchQueued",
    "EpisodeCreate",
    "EpisodeCreated",
    "EpisodeDetail",
    "EpisodePage",
    "EpisodeStatus",
    "EpisodeSummary",
    "EpisodeTimelines",
    "EventOut",
    "FinishIn",
    "ForkOut",
    "NegativeOut",
    "RewardIn",
    "TimelineMessage",
    "TimelineOut",
]

EpisodeStatus = Literal["running", "completed", "terminated", "truncated", "error", "aborted",
                        "invalid"]


class EpisodeCreate(BaseModel):
    """Start an episode of the run (appends its ``episode_started``). ``episode_id`` is
    generated when left out; ``event_id`` makes a retried start idempotent."""

    model_config = ConfigDict(extra="forbid")

    episode_id: str | None = Field(default=None, min_length=1, max_length=200,
                                   pattern=r"^[A-Za-z0-9_.:\-]+$")
    group_id: str = Field(min_length=1, max_length=200,
                          description="The GRPO group (one task prompt at one policy version).")
    task_id: str | None = None
    messages: list[dict[str, Any]] = Field(default_factory=list)
    tools: list[dict[str, Any]] = Field(default_factory=list)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    policy_version: StrictInt = Field(default=0, ge=0, le=2**31 - 1)
    event_id: uuid.UUID | None = None


class EpisodeCreated(BaseModel):
    episode_id: str
    run_id: str
    group_id: str
    version: int
    position: int
    duplicate: bool


#: A stream version: an integer (a boolean is refused), at most what the log's column holds.
StrictVersion = Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]


class AppendRequest(BaseModel):
    """A batch of events for one stream, stored all or nothing.

    ``expected_version``: the version the stream must be at (an integer, ``"no_stream"``, or
    ``"any"`` to skip the check); a stale one gets 409 with ``current_version``. Give every
    event an ``event_id``: sending the same batch again is then an idempotent retry (200,
    ``duplicate: true``). Each event is ``{"type": ..., <fields of that type>}``; token
    fields take a JSON array or base64 (little-endian int32 ids, float32 logprobs)."""

    model_config = ConfigDict(extra="forbid")

    expected_version: StrictVersion | Literal["any", "no_stream"] = Field(
        description="Version the stream must be at before this batch.", examples=[3])
    events: list[dict[str, Any]] = Field(min_length=1,
                                         description="Events, validated by type.")


class AppendResult(BaseModel):
    stream_id: str
    version: int = Field(description="The stream's version after the batch.")
    positions: list[int] = Field(description="Log position of each event of the batch.")
    duplicate: bool = Field(description="True when every event was stored before (a retry).")


class EpisodeSummary(BaseModel):
    """An episode as the log and, once replayed, the projection say. Counts are null until
    the episode is replayed (``projected_version`` set)."""

    episode_id: str
    run_id: str
    group_id: str | None
    task_id: str | None = None
    status: str
    reward: float | None = None
    policy_version: int | None = None
    branched_from: dict[str, Any] | None = Field(
        default=None, description="The episode and turn a branched episode started from.")
    started_at: dt.datetime
    finished_at: dt.datetime | None = None
    events: int
    invalid_reason: str | None = None
    projected_version: int | None = None
    llm_calls: int | None = None
    tool_calls: int | None = None
    tool_errors: int | None = None
    attempts_failed: int | None = None
    rollbacks: int | None = None
    timelines: int | None = None
    survivors: int | None = None
    forks: int | None = None
    drifted_messages: int | None = None
    negatives: int | None = None
    tokens: int | None = None


class EpisodePage(BaseModel):
    episodes: list[EpisodeSummary]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null at "
                                                "the end.")


class EventOut(BaseModel):
    position: int
    stream_version: int
    type: str
    event_id: str
    occurred_at: dt.datetime | None = None
    recorded_at: dt.datetime
    data: dict[str, Any] = Field(description="The event's fields but its token payloads.")
    tokens: dict[str, IntArray | FloatArray] | None = Field(
        default=None, description="prompt_ids, response_ids, logprobs of an llm_called.")


class EpisodeDetail(BaseModel):
    summary: EpisodeSummary
    events: list[EventOut]


class TimelineMessage(BaseModel):
    role: str
    author: str = Field(description="'llm' for the model's own output; env, user or tool.")
    text: str
    start: int = Field(description="Index of the message's first token in the timeline.")
    end: int = Field(description="One past its last token.")
    trainable: int = Field(description="Tokens of this message under the loss mask.")
    tool_calls: list[dict[str, Any]] | None = None
    truncated: bool = False
    discarded: bool = Field(default=False, description="The output of a discarded call "
                            "(rolled back or abandoned), here as context: never trained.")


class TimelineOut(BaseModel):
    """A surviving (merged) timeline: one training sample. ``loss_mask`` is 1 exactly on
    tokens the model sampled; ``logprobs`` are the engine's on those tokens, 0 elsewhere."""

    agent: str
    timeline_index: int
    absorbed: list[int] = Field(description="Recording indices of timelines merged into it.")
    prompt_length: int
    num_tokens: int
    num_trainable: int
    drifted_messages: int
    token_ids: IntArray
    loss_mask: IntArray
    logprobs: FloatArray
    messages: list[TimelineMessage]


class NegativeOut(BaseModel):
    """A failed attempt as it stood before rollback (a negative sample candidate)."""

    agent: str
    timeline_index: int
    call_id: str
    position_key: str
    retry_index: int
    error_types: list[str]
    error_messages: list[str]
    reward: float
    prompt_length: int
    token_ids: IntArray
    loss_mask: IntArray
    logprobs: FloatArray
    kept: bool = Field(description="Within the run's negative-sample cap for this episode.")


class ForkOut(BaseModel):
    agent: str
    timeline: int
    other: int
    message_index: int
    reason: str


class EpisodeTimelines(BaseModel):
    episode_id: str
    run_id: str
    group_id: str
    status: str | None
    reward: float | None
    timelines: list[TimelineOut]
    negatives: list[NegativeOut]
    forks: list[ForkOut]
    drifted_messages: int
    discarded_calls: list[str] = Field(
        default_factory=list, description="Calls whose output was discarded (rolled back or "
        "abandoned): in no timeline's training tokens, only in their negative samples.")


class RewardIn(BaseModel):
    """A reward for an episode: ``value`` (and each of ``components``) a finite number, not a
    boolean nor a string (422 naming the field otherwise). ``event_id`` makes a retried call
    idempotent."""

    model_config = ConfigDict(extra="forbid")

    value: RewardNumber
    components: dict[str, RewardNumber] = Field(default_factory=dict)
    source: str = Field(default="client", min_length=1, max_length=200)
    event_id: uuid.UUID | None = None


class FinishIn(BaseModel):
    """How an episode ended; ``reward``, when given, is recorded with it."""

    model_config = ConfigDict(extra="forbid")

    status: Literal["completed", "terminated", "truncated", "error", "aborted"] = "completed"
    reason: str | None = Field(default=None, max_length=10_000)
    reward: RewardNumber | None = None


class BranchCreate(BaseModel):
    """Start a group of new episodes from a recorded turn (LLM calls kept) or checkpoint of
    the episode: exactly one of ``turn`` and ``checkpoint``."""

    model_config = ConfigDict(extra="forbid")

    turn: StrictInt | None = Field(default=None, ge=0, le=2**31 - 1)
    checkpoint: str | None = Field(default=None, min_length=1, max_length=200)
    n: StrictInt | None = Field(default=None, ge=1, le=256,
                                description="Episodes to start (default: the run's group size).")
    group_index: StrictInt = Field(default=0, ge=0, le=2**31 - 1)


class BranchQueued(BaseModel):
    parent: str
    run_id: str
    turn: int
    checkpoint: str | None
    group_id: str
    episode_ids: list[str]
