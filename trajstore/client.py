"""A small Python client for agent code: capture through the gateway, reward, finish.

    from openai import OpenAI
    from trajstore.client import TrajstoreClient

    ts = TrajstoreClient("http://127.0.0.1:8000", api_key="tsk_...")
    episode = ts.episode("my-run")                      # ids only: nothing is sent yet
    llm = OpenAI(**episode.openai_kwargs)       # base_url, api_key, the group's header
    llm.chat.completions.create(model="...", messages=[...])   # creates run and episode
    episode.finish(reward=1.0)

The gateway creates the run (in the key's project) and the episode on the first call through
``openai_base_url``; ``reward`` and ``finish`` are the REST routes of the same names;
``abandoning()`` gives the headers of a retry that throws an earlier answer away.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import httpx

__all__ = ["Episode", "TrajstoreClient", "TrajstoreError"]


class TrajstoreError(RuntimeError):
    """The API refused a call: ``status`` and the error object it answered with."""

    def __init__(self, status: int, error: dict[str, Any]) -> None:
        super().__init__(f"{status} {error.get('code', '')}: {error.get('message', error)}")
        self.status = status
        self.error = error


class TrajstoreClient:
    """The REST API at ``base_url`` (no ``/v1``) with ``api_key`` (an ingest key). ``http``
    replaces the HTTP client (an ``httpx.Client``; tests pass an in-process one)."""

    def __init__(self, base_url: str, api_key: str, *, timeout: float = 600.0,
                 http: httpx.Client | None = None) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self._http = http or httpx.Client(timeout=timeout)

    def episode(self, run_id: str, episode_id: str | None = None, *,
                group_id: str | None = None) -> Episode:
        """An episode of ``run_id`` (a new id when none is given); created by its first
        gateway call."""
        return Episode(self, run_id, episode_id or f"ep-{uuid.uuid4().hex}", group_id)

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``path``; TrajstoreError for an answer that is not 2xx."""
        r = self._http.post(self.base_url + path, json=body,
                            headers={"Authorization": f"Bearer {self.api_key}"})
        if r.status_code >= 300:
            try:
                error = r.json().get("error", {})
            except ValueError:
                error = {"message": r.text[:500]}
            raise TrajstoreError(r.status_code, error)
        return dict(r.json())

    def close(self) -> None:
        self._http.close()


@dataclass(frozen=True)
class Episode:
    client: TrajstoreClient
    run_id: str
    episode_id: str
    group_id: str | None = None

    @property
    def openai_base_url(self) -> str:
        """The base URL to give an OpenAI client: its calls are recorded into this episode."""
        return f"{self.client.base_url}/v1/runs/{self.run_id}/episodes/{self.episode_id}"

    @property
    def openai_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``openai.OpenAI`` that record its calls into this episode
        (the base URL, the key, and the GRPO group as a default header)."""
        kwargs: dict[str, Any] = {"base_url": self.openai_base_url,
                                  "api_key": self.client.api_key}
        if self.group_id:
            kwargs["default_headers"] = {"X-Trajstore-Group": self.group_id}
        return kwargs

    @property
    def headers(self) -> dict[str, str]:
        """Headers that do the same on the plain gateway routes (``/v1/chat/completions``)."""
        headers = {"X-Trajstore-Run": self.run_id, "X-Trajstore-Episode": self.episode_id}
        if self.group_id:
            headers["X-Trajstore-Group"] = self.group_id
        return headers

    @staticmethod
    def abandoning(call_id: str = "previous") -> dict[str, str]:
        """Headers of a retry that throws away an earlier answer (its ``id``, or
        ``"previous"``: the agent's latest call): pass them as the OpenAI client's
        ``extra_headers``. The abandoned branch becomes a negative sample, not a positive
        one."""
        return {"X-Trajstore-Abandoned": call_id}

    def reward(self, value: float, *, components: dict[str, float] | None = None,
               event_id: uuid.UUID | None = None) -> dict[str, Any]:
        """Record a reward; a retry with the same ``event_id`` stores it once."""
        body: dict[str, Any] = {"value": value, "components": components or {}}
        if event_id is not None:
            body["event_id"] = str(event_id)
        return self.client.post(f"/v1/episodes/{self.episode_id}/reward", body)

    def finish(self, *, status: str = "completed", reward: float | None = None,
               reason: str | None = None) -> dict[str, Any]:
        """Finish the episode (idempotent), with its reward when given."""
        body: dict[str, Any] = {"status": status}
        if reward is not None:
            body["reward"] = reward
        if reason is not None:
            body["reason"] = reason
        return self.client.post(f"/v1/episodes/{self.episode_id}/finish", body)
