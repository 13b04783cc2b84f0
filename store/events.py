"""Event types: plain immutable data with no database imports.

Every event is a frozen pydantic model with a ``type`` name and a ``schema_version``.
Token payloads (``prompt_ids``, ``response_ids``, ``logprobs``) are numpy arrays (int32 /
float32) that the store keeps in binary columns, never in JSON. ``parse_event`` builds the
model of a stored or submitted ``(type, data)`` pair and upcasts older schema versions.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal, get_args, get_origin

import numpy as np
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationInfo,
    field_validator,
    model_validator,
)

__all__ = [
    "ABANDONED_ERROR_TYPE",
    "MAX_INT",
    "Event",
    "EVENT_TYPES",
    "TOKEN_FIELDS",
    "EGPO_ALPHA",
    "EGPO_LAM",
    "CorrectionConfig",
    "EgpoConfig",
    "failure_order_key",
    "MergeConfig",
    "RollbackConfig",
    "NegativeConfig",
    "RolloutConfig",
    "RunConfig",
    "RunCreated",
    "EpisodeStarted",
    "LLMCalled",
    "ToolReturned",
    "CheckpointCreated",
    "AttemptFailed",
    "RolledBack",
    "RewardAssigned",
    "RewardNumber",
    "EpisodeFinished",
    "PolicyServed",
    "PolicyUpdated",
    "parse_event",
    "event_type",
    "DEFAULT_ROLLBACK_ERRORS",
    "EPISODE_STATUSES",
]

INT32_MAX = 2**31 - 1

#: Names of the token payload fields; the store keeps them in binary columns.
TOKEN_FIELDS = ("prompt_ids", "response_ids", "logprobs")
#: The largest count or version an event may carry on append: what the projections' integer
#: columns hold, so that an event the log accepts can always be projected.
MAX_INT = 2**31 - 1


def _as_token_ids(value: Any) -> np.ndarray:
    """Token ids as a read-only int32 array; refuses floats, negatives and values past int32."""
    if isinstance(value, np.ndarray):
        arr = value
    else:
        try:
            arr = np.asarray(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"token ids must be a list of integers: {exc}") from None
    if arr.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        arr = arr.astype(np.int32)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got {arr.dtype}")
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0:
            raise ValueError(f"token ids must be non-negative, got {lo}")
        if hi > INT32_MAX:
            raise ValueError(f"token ids must fit in int32, got {hi}")
    out = np.ascontiguousarray(arr, dtype=np.int32)
    out.flags.writeable = False
    return out


def _as_logprobs(value: Any) -> np.ndarray:
    """Log-probabilities as a read-only float32 array; refuses NaN, infinities (also a value
    such as -1e400 that only float32 cannot hold) and positive values."""
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"logprobs must be a list of numbers: {exc}") from None
    if arr.ndim != 1:
        raise ValueError(f"logprobs must be one-dimensional, got shape {arr.shape}")
    if arr.size:
        if np.isnan(arr).any():
            raise ValueError("logprobs must not contain NaN")
        if (arr > 1e-4).any():
            raise ValueError(f"logprobs must be <= 0, got {float(arr.max())}")
    with np.errstate(over="ignore"):
        out = np.ascontiguousarray(arr, dtype=np.float32)
    if out.size and not np.isfinite(out).all():
        bad = int(np.flatnonzero(~np.isfinite(out))[0])
        raise ValueError(f"logprobs must be finite float32 values, entry {bad} is "
                         f"{float(arr[bad])}")
    out.flags.writeable = False
    return out


TokenIds = Annotated[
    np.ndarray,
    BeforeValidator(_as_token_ids),
    PlainSerializer(lambda a: a.tolist(), return_type=list),
]
Logprobs = Annotated[
    np.ndarray,
    BeforeValidator(_as_logprobs),
    PlainSerializer(lambda a: a.tolist(), return_type=list),
]


def _takes_bool(annotation: Any) -> bool:
    """Whether a field of this type annotation may hold a boolean (bool or Any in it)."""
    if annotation is bool or annotation is Any:
        return True
    return any(_takes_bool(a) for a in get_args(annotation))


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_number(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads true as 1: a boolean sent for a count, version or number
        # (or as a value of a dict of numbers) is a client bug, not a 1.
        if info.field_name is None:
            return value
        annotation = cls.model_fields[info.field_name].annotation
        if _takes_bool(annotation):
            return value
        if isinstance(value, bool):
            raise ValueError("must be a number, not a boolean")
        if (get_origin(annotation) is dict and isinstance(value, dict)
                and any(isinstance(v, bool) for v in value.values())):
            raise ValueError("values must be numbers, not booleans")
        return value


class Event(_Frozen):
    """Base of every event. ``event_id`` is the idempotency key (generated when absent)."""

    type: ClassVar[str] = ""
    schema_version: ClassVar[int] = 1

    event_id: uuid.UUID | None = None
    occurred_at: dt.datetime | None = None

    def to_data(self) -> dict[str, Any]:
        """The JSON part of the event: every field but the id, time and token payloads."""
        return self.model_dump(
            mode="json", exclude={"event_id", "occurred_at", *TOKEN_FIELDS}
        )

    def token_payloads(self) -> dict[str, np.ndarray]:
        """The binary payloads this event carries (empty for most types)."""
        return {}


EVENT_TYPES: dict[str, type[Event]] = {}


def event_type(cls: type[Event]) -> type[Event]:
    """Register an event class under its ``type``; refuses a name registered twice."""
    if not cls.type:
        raise TypeError(f"{cls.__name__} has no type name")
    if cls.type in EVENT_TYPES:
        raise TypeError(f"event type {cls.type!r} is already registered")
    EVENT_TYPES[cls.type] = cls
    return cls


# --- run configuration -------------------------------------------------------------------

DEFAULT_ROLLBACK_ERRORS = (
    "ImportError",
    "ModuleNotFoundError",
    "SyntaxError",
    "IndentationError",
    "NameError",
    "tool call format is wrong",
)


def failure_order_key(occurred_at: dt.datetime | None, episode_id: str | None,
                      index: int | None) -> tuple[Any, ...]:
    """The one order of failed attempts, by which a group's negative samples are chosen
    (replay) and leased (the cap): by time (naive times count as UTC, unknown times last),
    then episode id, then position in the episode stream."""
    if occurred_at is None:
        stamp: tuple[int, float] = (1, 0.0)
    else:
        if occurred_at.tzinfo is None:
            occurred_at = occurred_at.replace(tzinfo=dt.UTC)
        stamp = (0, occurred_at.timestamp())
    return (*stamp, episode_id or "", index or 0)


# EGPO's defaults (seed ``004``), written once: the run configuration and the trainer's
# functions read them from here.
EGPO_LAM = 0.4
EGPO_ALPHA = 2.0


class EgpoConfig(_Frozen):
    """EGPO's entropy bonus (seed ``004``): ``lam`` its weight (0 turns EGPO into GRPO),
    ``alpha`` the bound on it relative to the advantage, ``variant`` the bonus's form. The
    ``clip`` form keeps an advantage's sign only when ``lam < alpha``; a run that asks for
    more is refused when it is created, not at its first training step."""

    lam: float = Field(default=EGPO_LAM, ge=0)
    alpha: float = Field(default=EGPO_ALPHA, gt=0)
    variant: Literal["clip", "paper"] = "clip"

    @model_validator(mode="after")
    def _clip_keeps_the_sign(self) -> EgpoConfig:
        if self.variant == "clip" and self.lam > 0 and not self.lam < self.alpha:
            raise ValueError(
                f"egpo.lam ({self.lam}) must be below egpo.alpha ({self.alpha}) for the 'clip' "
                "variant, or the bonus can flip a negative advantage"
            )
        return self


class MergeConfig(_Frozen):
    compare_level: Literal["text", "token"] = "text"
    ignore_tools: bool = True


class RollbackConfig(_Frozen):
    enable_tool_rollback: bool = True
    max_tool_retries: int = Field(default=3, ge=0)
    rollback_on_errors: tuple[str, ...] = DEFAULT_ROLLBACK_ERRORS
    save_negative_samples: bool = True


class NegativeConfig(_Frozen):
    negative_reward: float = -1.0
    max_negative_samples_per_group: int = Field(default=1, ge=0)


class RolloutConfig(_Frozen):
    """How a run's rollout workers sample: per-call sampling and per-episode limits."""

    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    max_tokens: int = Field(default=256, ge=1)
    max_turns: int = Field(default=8, ge=1)
    max_total_tokens: int = Field(default=4096, ge=1)


class CorrectionConfig(_Frozen):
    """Off-policy correction from the rollout log-probs (``workers.trainer.correction``).

    ``is_level``: "none", "token" (truncated IS per token, ``min(ratio, is_threshold)``) or
    "sequence" (one truncated weight per sample); ``rejection``: "none", "token" or "sequence"
    (drop tokens, or whole samples, whose ``pi_rollout / pi_train`` leaves
    ``[rejection_lower, rejection_upper]``; lower defaults to ``1 / rejection_upper``).
    Defaults: token-level TIS with cap 2, no rejection. Out-of-range values are refused at
    run creation, naming the field.
    """

    is_level: Literal["none", "token", "sequence"] = "token"
    is_threshold: float = Field(default=2.0, ge=1.0, le=1e6, allow_inf_nan=False)
    rejection: Literal["none", "token", "sequence"] = "none"
    rejection_upper: float = Field(default=2.0, ge=1.0, le=1e6, allow_inf_nan=False)
    rejection_lower: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)


class RunConfig(_Frozen):
    group_size: int = Field(default=8, ge=1)
    rollout: RolloutConfig = RolloutConfig()
    egpo: EgpoConfig = EgpoConfig()
    merge: MergeConfig = MergeConfig()
    rollback: RollbackConfig = RollbackConfig()
    negatives: NegativeConfig = NegativeConfig()
    correction: CorrectionConfig = CorrectionConfig()
    # Rollout-level advantages: GRPO/EGPO statistics over episodes (an episode that yielded
    # several samples counts once; each negative sample is its own unit) and equal episode
    # weight in the loss. Identical to sample level when every episode yields one sample.
    rollout_level: bool = True
    model: str | None = None
    tokenizer: str | None = None
    chat_template: str | None = None

    @property
    def tokenizer_name(self) -> str | None:
        """The tokenizer the run's prompts are rendered and replayed with: ``tokenizer``,
        else ``model`` (the model folder's own tokenizer), else None (the run names none).
        Rollout, replay, the gateway, exports and the trainer all read it here."""
        return self.tokenizer or self.model


# --- events ------------------------------------------------------------------------------


@event_type
class RunCreated(Event):
    type: ClassVar[str] = "run_created"
    run_id: str = Field(min_length=1, max_length=200)
    project: str = Field(default="default", min_length=1, max_length=200)
    config: RunConfig = RunConfig()


@event_type
class EpisodeStarted(Event):
    type: ClassVar[str] = "episode_started"
    run_id: str = Field(min_length=1, max_length=200)
    group_id: str = Field(min_length=1, max_length=200)
    task_id: str | None = None
    messages: list[dict[str, Any]] = Field(default_factory=list)
    tools: list[dict[str, Any]] = Field(default_factory=list)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    policy_version: int = Field(default=0, ge=0)


@event_type
class LLMCalled(Event):
    type: ClassVar[str] = "llm_called"
    agent: str = Field(default="main", min_length=1, max_length=200)
    call_id: str = Field(min_length=1, max_length=200)
    messages: list[dict[str, Any]] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    prompt_ids: TokenIds
    response_ids: TokenIds
    logprobs: Logprobs
    response: dict[str, Any] = Field(default_factory=dict)
    finish_reason: str | None = None
    policy_version: int = Field(default=0, ge=0)
    latency_ms: float | None = None
    usage: dict[str, Any] | None = None

    @field_validator("logprobs")
    @classmethod
    def _lengths_agree(cls, logprobs: np.ndarray, info: ValidationInfo) -> np.ndarray:
        response = info.data.get("response_ids")
        if response is not None and len(logprobs) != len(response):
            raise ValueError(
                f"logprobs has {len(logprobs)} entries but response_ids has "
                f"{len(response)}; they must be of equal length"
            )
        return logprobs

    def to_data(self) -> dict[str, Any]:
        # The request history is the bulk of this event and is already plain JSON data (it
        # was validated as lists and dicts): hand it over as is instead of re-serialising it.
        return {
            "agent": self.agent,
            "call_id": self.call_id,
            "messages": self.messages,
            "tools": self.tools,
            "response": self.response,
            "finish_reason": self.finish_reason,
            "policy_version": self.policy_version,
            "latency_ms": self.latency_ms,
            "usage": self.usage,
        }

    def token_payloads(self) -> dict[str, np.ndarray]:
        return {
            "prompt_ids": self.prompt_ids,
            "response_ids": self.response_ids,
            "logprobs": self.logprobs,
        }


@event_type
class ToolReturned(Event):
    type: ClassVar[str] = "tool_returned"
    agent: str = Field(default="main", min_length=1, max_length=200)
    tool_call_id: str | None = None
    name: str = Field(min_length=1, max_length=200)
    arguments: dict[str, Any] = Field(default_factory=dict)
    output: str = ""
    is_error: bool = False
    error_type: str | None = None
    error_message: str | None = None
    duration_ms: float | None = None


@event_type
class CheckpointCreated(Event):
    type: ClassVar[str] = "checkpoint_created"
    agent: str = Field(default="main", min_length=1, max_length=200)
    checkpoint_id: str = Field(min_length=1, max_length=200)
    position_key: str = Field(pattern=r"^turn_\d+$")
    retry_count: int = Field(default=0, ge=0)


#: The error type of an ``attempt_failed`` for a call the client abandoned (a retry that threw
#: the answer away, ``X-Trajstore-Abandoned``). With a ``rolled_back`` discarding that call,
#: replay never makes it a positive sample.
ABANDONED_ERROR_TYPE = "Abandoned"


@event_type
class AttemptFailed(Event):
    type: ClassVar[str] = "attempt_failed"
    agent: str = Field(default="main", min_length=1, max_length=200)
    checkpoint_id: str = Field(min_length=1, max_length=200)
    position_key: str = Field(pattern=r"^turn_\d+$")
    retry_index: int = Field(ge=0)
    error_messages: list[str] = Field(default_factory=list)
    error_types: list[str] = Field(default_factory=list)
    failed_tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    failed_call_id: str | None = None


@event_type
class RolledBack(Event):
    type: ClassVar[str] = "rolled_back"
    agent: str = Field(default="main", min_length=1, max_length=200)
    checkpoint_id: str = Field(min_length=1, max_length=200)
    discarded_call_ids: list[str] = Field(default_factory=list)


#: A reward or one of its components: a finite number, never a boolean (refused by
#: ``_Frozen``), nor a string that looks like one (strict).
RewardNumber = Annotated[float, Field(strict=True, allow_inf_nan=False)]


@event_type
class RewardAssigned(Event):
    """An episode's reward. The latest one in the stream is the episode's reward; it may
    arrive after ``episode_finished`` as long as none of the episode's samples was consumed
    (``store.eventlog``: the one event a finished episode still takes)."""

    type: ClassVar[str] = "reward_assigned"
    value: RewardNumber
    components: dict[str, RewardNumber] = Field(default_factory=dict)
    source: str = "task"


EPISODE_STATUSES = ("completed", "terminated", "truncated", "error", "aborted")


@event_type
class EpisodeFinished(Event):
    type: ClassVar[str] = "episode_finished"
    status: Literal["completed", "terminated", "truncated", "error", "aborted"]
    reason: str | None = None


@event_type
class PolicyUpdated(Event):
    type: ClassVar[str] = "policy_updated"
    version: int = Field(ge=0)
    step: int = Field(ge=0)
    metrics: dict[str, float] = Field(default_factory=dict)
    checkpoint: str | None = None


@event_type
class PolicyServed(Event):
    """A rollout engine took a policy version of the run (``store.serving``): its stable id
    (host, process, backend), the backend kind, where the weights came from (a checkpoint
    folder or URL, ``push`` from a trainer in the same process, a server's weight-update
    route) and how long loading them took."""

    type: ClassVar[str] = "policy_served"
    version: int = Field(ge=0)
    engine: str = Field(min_length=1, max_length=200)
    backend: str = Field(min_length=1, max_length=100)
    source: str | None = Field(default=None, max_length=2000)
    load_seconds: float | None = Field(default=None, ge=0, allow_inf_nan=False)


# --- upcasting ---------------------------------------------------------------------------

#: (type, stored schema version) -> function turning that version's data into the next one's.
UPCASTERS: dict[tuple[str, int], Callable[[dict[str, Any]], dict[str, Any]]] = {}


def parse_event(
    type_name: str,
    data: dict[str, Any],
    *,
    schema_version: int | None = None,
    tokens: dict[str, Any] | None = None,
    event_id: uuid.UUID | str | None = None,
    occurred_at: dt.datetime | None = None,
) -> Event:
    """Build the event model of ``type_name`` from its JSON ``data`` (and token payloads).

    Raises ``KeyError`` naming the type when it is unknown and pydantic's
    ``ValidationError`` when the data does not fit the schema. Data stored under an older
    ``schema_version`` is upcast step by step to the current one first.
    """
    cls = EVENT_TYPES.get(type_name)
    if cls is None:
        raise KeyError(f"unknown event type {type_name!r}; known: {sorted(EVENT_TYPES)}")
    version = cls.schema_version if schema_version is None else schema_version
    if version > cls.schema_version:
        raise ValueError(
            f"{type_name} schema version {version} is newer than this code's "
            f"{cls.schema_version}"
        )
    while version < cls.schema_version:
        data = UPCASTERS[(type_name, version)](dict(data))
        version += 1
    fields: dict[str, Any] = dict(data)
    if tokens:
        fields.update(tokens)
    if event_id is not None:
        fields["event_id"] = event_id
    if occurred_at is not None:
        fields["occurred_at"] = occurred_at
    return cls.model_validate(fields)
