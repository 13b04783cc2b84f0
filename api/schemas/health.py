"""Liveness, readiness and the caller's own key."""

from __future__ import annotations

from pydantic import BaseModel

__all__ = ["Health", "Readiness", "WhoAmI"]


class Health(BaseModel):
    status: str
    #: True when requests without an API key act as the local project's admin; left out
    #: of the answer otherwise (a server without local mode answers as it always did).
    local_mode: bool | None = None


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
