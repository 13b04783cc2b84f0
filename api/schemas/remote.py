"""Remote rollout (TrainGate protocol): the completion callback and the RolloutServer's
``/rollout`` request."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from api.schemas.openai import ChatMessage
from store.arguments import RealNumber, WholeNumber
from store.events import RewardNumber

__all__ = [
    "RolloutCompleted",
    "RolloutCompletedAck",
    "RolloutInitAccepted",
    "RolloutInitRequest",
    "RolloutRequest",
    "RolloutSamplingParams",
]


def _not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be blank")
    return value


def _http_url(value: str) -> str:
    if not value.startswith(("http://", "https://")):
        raise ValueError(f"server_url must be an http(s) URL, got {value[:80]!r}")
    return value.rstrip("/")


#: A rollout's id as both protocol revisions send it: 1-150 characters, not blank.
RolloutId = Annotated[str, Field(min_length=1, max_length=150), AfterValidator(_not_blank)]
#: The trainer's base URL (or a completions endpoint): http(s), without a trailing slash.
ServerUrl = Annotated[str, Field(min_length=8, max_length=2000), AfterValidator(_http_url)]


class RolloutCompleted(BaseModel):
    """What a RolloutServer posts to ``/v1/rollout/completed`` when a rollout ends (its
    ``RolloutResponse``). Its reward (``reward``, ``reward_score``, ``extra_fields.reward``,
    ``extra_fields.reward_score``, ``extra_fields.reward_extra_info.reward`` or
    ``metrics.reward``: ``api.routers.rollout``) is recorded before the episode is finished,
    when given."""

    model_config = ConfigDict(extra="allow")

    rollout_id: str = Field(min_length=1, max_length=200)
    status: Literal["COMPLETED", "ERROR"]
    final_messages: list[ChatMessage] | None = None
    finish_reason: str | None = Field(default=None, max_length=200)
    error_message: str | None = None
    metrics: dict[str, Any] | None = None
    extra_fields: dict[str, Any] | None = None
    reward: RewardNumber | None = None


class RolloutCompletedAck(BaseModel):
    rollout_id: str
    status: str = Field(description="The episode's recorded status.")
    reward: float | None
    version: int
    duplicate: bool = Field(description="True when this callback was recorded before.")


class RolloutSamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    temperature: RealNumber | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: RealNumber | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    max_tokens: WholeNumber | None = Field(default=None, ge=1, le=1_000_000)
    seed: WholeNumber | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: list[str] | None = None
    logprobs: bool | None = None
    top_k: WholeNumber | None = None
    min_p: RealNumber | None = Field(default=None, allow_inf_nan=False)
    presence_penalty: RealNumber | None = Field(default=None, allow_inf_nan=False)
    frequency_penalty: RealNumber | None = Field(default=None, allow_inf_nan=False)
    repetition_penalty: RealNumber | None = Field(default=None, allow_inf_nan=False)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(not s for s in value):
            raise ValueError("stop strings must be non-empty")
        return value


class RolloutRequest(BaseModel):
    """``POST /rollout`` (the protocol's RolloutRequest): drive one rollout, calling back
    the trainer at ``server_url`` for every generation (``/v1/chat/completions``, or
    ``/v1/completions`` when the trainer serves only that; a ``server_url`` ending in either
    path uses that one). ``run_id`` (default ``remote``) names the run of this store the
    rollout is recorded in, which must be the key's project's; ``group_id`` its GRPO group.
    ``metadata`` and ``tool_server_url`` (sent by every revision of the reference
    RolloutRequest) are accepted and not used; other unknown fields are refused (422 naming
    them)."""

    model_config = ConfigDict(extra="forbid")

    rollout_id: RolloutId
    server_url: ServerUrl
    messages: list[ChatMessage] = Field(min_length=1)
    sampling_params: RolloutSamplingParams | None = None
    tokenizer_name: Annotated[str, Field(min_length=1, max_length=500),
                              AfterValidator(_not_blank)]
    tokenizer_revision: str | None = Field(default=None, max_length=200)
    max_turns: WholeNumber | None = Field(default=None, ge=1, le=100)
    max_tokens_total: WholeNumber | None = Field(default=None, ge=1, le=1_000_000)
    callback_api_key: str | None = Field(default=None, max_length=1000)
    run_id: str | None = Field(default=None, min_length=1, max_length=200)
    group_id: str | None = Field(default=None, min_length=1, max_length=200)
    metadata: dict[str, Any] | None = None
    tool_server_url: str | None = Field(default=None, max_length=2000)



class RolloutInitRequest(BaseModel):
    """``POST /v1/rollout/init`` (the protocol's asynchronous revision): start one rollout
    in the background, calling the trainer at ``server_url`` for every generation with
    ``api_key`` as Bearer token, and post its RolloutResponse to
    ``{server_url}/v1/rollout/completed`` when it ends. ``completion_params`` are the
    sampling parameters; there is no ``tokenizer_name``: the rollout is played with the
    run's tokenizer. ``run_id`` (default ``remote``) and ``group_id`` are this store's, as
    for ``POST /rollout``; ``metadata``, ``tool_server_url`` and ``idempotency_key`` are
    accepted and not used; other unknown fields are refused (422 naming them)."""

    model_config = ConfigDict(extra="forbid")

    rollout_id: RolloutId
    server_url: ServerUrl
    messages: list[ChatMessage] = Field(min_length=1)
    completion_params: RolloutSamplingParams | None = None
    api_key: str | None = Field(default=None, max_length=1000)
    max_turns: WholeNumber | None = Field(default=None, ge=1, le=100)
    max_tokens_total: WholeNumber | None = Field(default=None, ge=1, le=1_000_000)
    run_id: str | None = Field(default=None, min_length=1, max_length=200)
    group_id: str | None = Field(default=None, min_length=1, max_length=200)
    metadata: dict[str, Any] | None = None
    tool_server_url: str | None = Field(default=None, max_length=2000)
    idempotency_key: str | None = Field(default=None, max_length=200)



class RolloutInitAccepted(BaseModel):
    """The answer to ``POST /v1/rollout/init`` (202): the tools the model is offered."""

    rollout_id: str
    tools: list[dict[str, Any]]
