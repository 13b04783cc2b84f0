"""Liveness, readiness and the caller's own key."""

from __future__ import annotations

from pydantic import BaseModel

__all__ = ["Health", "Readiness", "WhoAmI"]


class Health(BaseModel):
    status: str


class Readiness(BaseModel):
    status: str
    database: str
    revision: str | None = None
    head: str | None = None
    detail: str | None = None
    #: ``following`` when a process replays finished episodes, ``none`` when none does.
    replay: str | None = None
    warnings: list[str] = []


class WhoAmI(BaseModel):
    key_id: str
    project: str
    role: str
