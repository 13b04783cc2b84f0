"""Remote rollout (TrainGate protocol): the completion callback and the RolloutServer's
``/rollout`` request."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from api.schemas.openai import ChatMessage

__all__ = [
    "RolloutCompleted",
    "RolloutCompletedAck",
    "RolloutRequest",
    "RolloutSamplingParams",
]


class RolloutCompleted(BaseModel):
    """What a RolloutServer posts to ``/v1/rollout/completed`` when a rollout ends (its
    ``RolloutResponse``). ``reward`` (or ``extra_fields.reward``) is recorded before the
    episode is finished, when given."""

    model_config = ConfigDict(extra="allow")

    rollout_id: str = Field(min_length=1, max_length=200)
    status: Literal["COMPLETED", "ERROR"]
    final_messages: list[ChatMessage] | None = None
    finish_reason: str | None = Field(default=None, max_length=200)
    error_message: str | None = None
    metrics: dict[str, Any] | None = None
    extra_fields: dict[str, Any] | None = None
    reward: float | None = Field(default=None, allow_inf_nan=False)


class RolloutCompletedAck(BaseModel):
    rollout_id: str
    status: str = Field(description="The episode's recorded status.")
    reward: float | None
    version: int
    duplicate: bool = Field(description="True when this callback was recorded before.")


class RolloutSamplingParams(BaseModel):
    model_config = ConfigDict(extra="allow")

    temperature: float = Field(default=1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False)
    max_tokens: int = Field(default=512, ge=1, le=1_000_000)
    stop: list[str] | None = None
    logprobs: bool | None = True


class RolloutRequest(BaseModel):
    """``POST /rollout``: drive one rollout, calling back ``server_url``'s
    ``/v1/completions`` for every generation."""

    model_config = ConfigDict(extra="allow")

    rollout_id: str = Field(min_length=1, max_length=256)
    server_url: str = Field(min_length=8, max_length=2000)
    messages: list[ChatMessage] = Field(min_length=1)
    sampling_params: RolloutSamplingParams = Field(default_factory=RolloutSamplingParams)
    tokenizer_name: str | None = Field(default=None, max_length=500)
    tokenizer_revision: str | None = Field(default=None, max_length=200)
    max_turns: int = Field(default=10, ge=1, le=100)
    max_tokens_total: int = Field(default=8192, ge=1, le=1_000_000)
    metadata: dict[str, Any] = Field(default_factory=dict)
    api_key: str | None = None

    @field_validator("rollout_id")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("rollout_id must not be blank")
        return value

    @field_validator("server_url")
    @classmethod
    def _http(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"server_url must be an http(s) URL, got {value[:80]!r}")
        return value.rstrip("/")
