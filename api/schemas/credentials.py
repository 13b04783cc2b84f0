"""Credentials of one episode: minting one for a user's RolloutServer."""

from __future__ import annotations

import datetime as dt

from pydantic import BaseModel, ConfigDict, Field

from store.api_keys import MAX_EPISODE_KEY_TTL_S

__all__ = ["CredentialCreate", "CredentialCreated"]


class CredentialCreate(BaseModel):
    """How long the credential lives: ``ttl_s`` seconds, a finite number from 1 to
    ``MAX_EPISODE_KEY_TTL_S`` (86460: the longest rollout, a day, and a minute); a boolean,
    a string or anything out of that range is 422 naming ``body.ttl_s``."""

    model_config = ConfigDict(extra="forbid")

    ttl_s: float = Field(ge=1, le=MAX_EPISODE_KEY_TTL_S, allow_inf_nan=False, strict=True,
                         examples=[960])


class CredentialCreated(BaseModel):
    """A new credential of one episode: ``token`` is shown this once; the key is refused
    (401) from ``expires_at`` on, or once revoked."""

    key_id: str = Field(examples=["0123456789abcdef"])
    token: str
    expires_at: dt.datetime
