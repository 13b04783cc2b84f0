"""OpenAI-compatible requests of the capture gateway, with the remote-rollout (TrainGate)
extensions ``rollout_id`` and ``response_mask``.

Numbers are strict (``store.arguments``): a boolean or a string for a number is refused
(422 naming the field). Every field may be sent as an explicit ``null`` (meaning "not
given"), and unknown fields are accepted: they are forwarded to an upstream server unchanged
(and ignored by the in-process engine). Messages keep unknown keys too.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from store.arguments import RealNumber, WholeNumber

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "CompletionResponse",
]


class ChatMessage(BaseModel):
    """An OpenAI chat message; keys beyond these are kept as sent."""

    model_config = ConfigDict(extra="allow")

    role: str = Field(min_length=1, max_length=64)
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: RealNumber | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: RealNumber | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    max_tokens: WholeNumber | None = Field(default=None, ge=1)
    n: WholeNumber | None = Field(default=None, ge=1, le=1, description="Only 1 is supported.")
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: WholeNumber | None = Field(default=None, ge=0, le=2**63 - 1)
    return_token_ids: bool | None = Field(
        default=None, description="vLLM extension: include prompt_token_ids and token_ids.")
    tools: list[dict[str, Any]] | None = None
    rollout_id: str | None = Field(
        default=None, min_length=1, max_length=256,
        description="Remote rollout (TrainGate): the episode this call belongs to.")
    response_mask: list[WholeNumber] | None = Field(
        default=None, max_length=1_048_576,
        description="Remote rollout: null on a rollout's first call, then one 0 per token "
                    "added since the previous generation (tool outputs, template tokens).")

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        items = [value] if isinstance(value, str) else (value or [])
        if any(not s for s in items):
            raise ValueError("stop strings must be non-empty")
        return value


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    tool_choice: str | dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: WholeNumber | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: WholeNumber | None = Field(default=None, ge=1)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: a ``prompt`` (text or token ids), or, as TrainGate's
    RolloutServer sends it, ``messages`` with a ``rollout_id``."""

    prompt: str | list[WholeNumber] | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    logprobs: WholeNumber | bool | None = Field(default=None)
    echo: bool | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: str | list[int] | None) -> str | list[int] | None:
        if isinstance(value, list):
            if not value:
                raise ValueError("prompt token ids must not be empty")
            if any(i < 0 or i > 2**31 - 1 for i in value):
                raise ValueError("prompt token ids must be non-negative int32 values")
        return value


class CompletionResponse(BaseModel):
    """An OpenAI ``chat.completion`` / ``text_completion`` answer. With ``return_token_ids``
    (and always for remote rollouts) it also carries ``prompt_token_ids`` and ``token_ids``;
    remote rollouts add ``logprobs`` (one float per generated token) and ``mask_check``."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: str
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: dict[str, Any] | None = None
