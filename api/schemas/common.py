"""Schemas shared by every resource: the error body and token arrays."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ErrorBody", "ErrorDetail", "FloatArray", "IntArray"]

#: Token ids or masks: a JSON array, or base64 of little-endian int32 / uint8 (see docs/api.md).
IntArray = list[int] | str
#: Log-probabilities: a JSON array, or base64 of little-endian float32.
FloatArray = list[float] | str


class ErrorDetail(BaseModel):
    """What went wrong. ``code`` is stable and machine-readable; ``message`` names the field
    and value at fault. Some errors carry more: ``field`` and ``event_index`` (422),
    ``current_version`` (409 on a stale ``expected_version``)."""

    model_config = ConfigDict(extra="allow")

    code: str = Field(examples=["version_conflict"])
    message: str = Field(examples=["stream 'ep-1' is at version 4, the append expected 3"])


class ErrorBody(BaseModel):
    """Every error response: ``{"error": {"code", "message", ...}}``."""

    error: ErrorDetail


def example(value: Any) -> dict[str, Any]:
    """``json_schema_extra`` giving one example."""
    return {"examples": [value]}
