"""What a rollout worker reads and writes, on the database or through the HTTP API.

A :class:`GroupLog` appends events with expected versions (the store's signature), tells a
stream's version and whether it finished, and reads a run's configuration and newest policy.
It reads an episode's events (the parent of a branch, :mod:`workers.rollout.branch`) and
records which policy version the worker's engine took (``policy_served``,
:mod:`store.serving`). Two implementations:

- :class:`StoreGroupLog` on an :class:`~store.eventlog.EventStore` (workers that reach the
  database);
- :class:`ApiGroupLog` on a trajstore API (workers on other machines): ``POST
  /v1/episodes/{id}/events`` to append, ``GET /v1/episodes/{id}`` (``?tokens=false`` except
  to resume an episode) and ``GET /v1/runs/{id}`` to read, ``POST /v1/runs/{id}/served`` to
  report the policy version an engine took, with a key that may read and ingest (role
  ``admin``; the same client mints the credentials of a remote agent's episodes,
  :class:`~workers.rollout.credentials.ApiCredentials`). The API's
  answers are translated into the store's errors (409 → ``ConflictError`` /
  ``IdempotencyError``, 422 → ``ValidationError``, 404 → ``NotFoundError``, 5xx and network
  failures → ``TransientError``, other refusals (401, 403, 413) → ``StoreError``), so callers
  handle both logs alike. The API does not expose checkpoint paths: through it, the policy's
  checkpoint is unknown (None).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from store import errors
from store.eventlog import EventStore
from store.events import EpisodeFinished, Event, RewardAssigned, RunConfig
from store.serving import newest_policy, record_policy_served

__all__ = ["ApiGroupLog", "GroupLog", "PolicyState", "StoreGroupLog", "StreamState"]


@dataclass(frozen=True)
class StreamState:
    """An episode stream as the log holds it: ``version`` (0: it does not exist), its
    ``episode_finished`` status and reason when it has one, its reward when assigned."""

    version: int
    status: str | None = None
    reason: str | None = None
    reward: float | None = None

    @property
    def finished(self) -> bool:
        return self.status is not None


@dataclass(frozen=True)
class PolicyState:
    """A run's newest policy: ``version`` (0 when never updated) and the checkpoint folder its
    ``policy_updated`` names (None when unknown)."""

    version: int = 0
    checkpoint: str | None = None


@runtime_checkable
class GroupLog(Protocol):
    """The reads and writes of a rollout worker (module docstring)."""

    def append(self, stream_id: str, events: Sequence[Event], expected_version: Any = ...
               ) -> Any:
        """Append with an expected version (the store's semantics and errors)."""
        ...

    def stream_version(self, stream_id: str) -> int:
        """The number of events in ``stream_id`` (0 when it does not exist)."""
        ...

    def stream_state(self, stream_id: str) -> StreamState:
        """Version, final status and reward of an episode stream."""
        ...

    def run_config(self, run_id: str) -> RunConfig:
        """The run's configuration; ``NotFoundError`` for an unknown run."""
        ...

    def read_episode(self, episode_id: str) -> list[Event]:
        """An episode's events with their token payloads (a branch's parent);
        ``NotFoundError`` for an unknown episode."""
        ...

    def policy(self, run_id: str, version: int | None = None) -> PolicyState:
        """The run's newest policy version and checkpoint; with ``version``, that version's
        (ValueError when the run has not reached it, or the log cannot give it)."""
        ...

    def policy_served(self, run_id: str, *, version: int, engine: str, backend: str,
                      source: str | None = None, load_seconds: float | None = None) -> None:
        """Record that ``engine`` now serves ``version`` of the run
        (``store.serving.record_policy_served``; its errors)."""
        ...


class StoreGroupLog:
    """:class:`GroupLog` on an event store. Raises TypeError for anything else."""

    def __init__(self, store: EventStore) -> None:
        if not isinstance(store, EventStore):
            raise TypeError(f"store must be an EventStore, got {type(store).__name__}")
        self.store = store

    def append(self, stream_id: str, events: Sequence[Event], expected_version: Any = "any"
               ) -> Any:
        return self.store.append(stream_id, events, expected_version)

    async def aappend(self, stream_id: str, events: Sequence[Event],
                      expected_version: Any = "any") -> Any:
        """:meth:`append` for the agent loop: concurrent episodes share transactions."""
        return await self.store.aappend(stream_id, events, expected_version)

    def stream_version(self, stream_id: str) -> int:
        return self.store.stream_version(stream_id)

    def stream_state(self, stream_id: str) -> StreamState:
        version = self.store.stream_version(stream_id)
        if version == 0:
            return StreamState(0)
        tail = [r.event for r in self.store.read_stream(stream_id,
                                                        from_version=max(1, version - 1))]
        return _state(version, tail)

    def stream_events(self, stream_id: str) -> list[Event]:
        """Every event of ``stream_id`` in order (empty when it does not exist): what a
        resumed episode replays (:func:`~workers.rollout.loop.arun_episode`'s ``resume``)."""
        return [r.event for r in self.store.read_stream(stream_id)]

    def run_config(self, run_id: str) -> RunConfig:
        return self.store.get_run(run_id).config

    def read_episode(self, episode_id: str) -> list[Event]:
        """Every event of an episode, with its token payloads, in stream order;
        ``NotFoundError`` naming it when there is no such episode."""
        return [r.event for r in self.store.get_episode(episode_id)]

    def policy(self, run_id: str, version: int | None = None) -> PolicyState:
        # One row, whatever the number of engines' reports in the run's stream.
        found, checkpoint = newest_policy(self.store, run_id, at_most=version)
        if version is not None and found != version:
            raise ValueError(f"run {run_id!r} has no policy version {version} (newest: "
                             f"{newest_policy(self.store, run_id)[0]})")
        return PolicyState(found, checkpoint)

    def policy_served(self, run_id: str, *, version: int, engine: str, backend: str,
                      source: str | None = None, load_seconds: float | None = None) -> None:
        record_policy_served(self.store, run_id, version=version, engine=engine,
                             backend=backend, source=source, load_seconds=load_seconds)


def _state(version: int, tail: Sequence[Event]) -> StreamState:
    finished = tail[-1] if tail and isinstance(tail[-1], EpisodeFinished) else None
    reward = next((e.value for e in reversed(tail) if isinstance(e, RewardAssigned)), None)
    if finished is None:
        return StreamState(version, reward=reward)
    return StreamState(version, finished.status, finished.reason, reward)


def _wire(event: Event) -> dict[str, Any]:
    """An event as the API's append route takes it."""
    body: dict[str, Any] = {"type": event.type, **event.to_data()}
    if event.event_id is not None:
        body["event_id"] = str(event.event_id)
    if event.occurred_at is not None:
        body["occurred_at"] = event.occurred_at.isoformat()
    for name, array in event.token_payloads().items():
        body[name] = array.tolist()
    return body


class ApiGroupLog:
    """:class:`GroupLog` through a trajstore API (module docstring). ``base_url`` like
    ``http://host:8600``; ``api_key`` sent as a Bearer token. Raises ValueError for a URL that
    is not http(s) or an empty key."""

    def __init__(self, base_url: str, *, api_key: str, timeout_s: float = 60.0) -> None:
        import httpx

        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"api_url must be an http(s) URL, got {base_url!r}")
        if not isinstance(api_key, str) or not api_key:
            raise ValueError("api_key must be a non-empty string")
        self.client = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s,
                                   headers={"Authorization": f"Bearer {api_key}"})

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self.client.close()

    def request(self, method: str, path: str, *, stream_id: str = "",
                expected: object = None, **kwargs: Any) -> Any:
        """One call to the API (``kwargs`` go to httpx): its JSON answer (None for 204 No
        Content), or the store's error for a refusal (module docstring; ``stream_id`` and
        ``expected`` fill a ``ConflictError``)."""
        import httpx

        try:
            response = self.client.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise errors.TransientError(f"{method} {path}: {type(exc).__name__}: {exc}"
                                        ) from None
        if response.status_code == 204:
            return None
        if response.status_code < 400:
            return response.json()
        try:
            error = response.json().get("error", {})
        except ValueError:
            error = {}
        message = f"{method} {path} returned {response.status_code}: " + str(
            error.get("message") or response.text[:300])
        status = response.status_code
        if status == 409 and "current_version" in error:
            raise errors.ConflictError(stream_id, expected=expected,
                                       actual=int(error["current_version"]))
        if status == 409 and "event_id" in error:
            raise errors.IdempotencyError(error["event_id"], position=int(
                error.get("position", -1)))
        if status == 404:
            raise errors.NotFoundError(message)
        if status == 422:
            raise errors.ValidationError(message, event_index=error.get("event_index"),
                                         field=error.get("field"))
        if status >= 500:
            raise errors.TransientError(message)
        raise errors.StoreError(message)

    def append(self, stream_id: str, events: Sequence[Event], expected_version: Any = "any"
               ) -> Any:
        body = {"expected_version": expected_version,
                "events": [_wire(event) for event in events]}
        return self.request("POST", f"/v1/episodes/{stream_id}/events", json=body,
                             stream_id=stream_id, expected=expected_version)

    def stream_version(self, stream_id: str) -> int:
        return self.stream_state(stream_id).version

    def stream_state(self, stream_id: str) -> StreamState:
        from store.events import parse_event

        try:
            detail = self.request("GET", f"/v1/episodes/{stream_id}",
                                   params={"tokens": "false"})
        except errors.NotFoundError:
            return StreamState(0)
        events = detail.get("events") or []
        if not events:
            return StreamState(0)
        tail = [parse_event(e["type"], e["data"]) for e in events[-2:]
                if e["type"] in ("reward_assigned", "episode_finished")]
        return _state(int(events[-1]["stream_version"]), tail)

    def stream_events(self, stream_id: str) -> list[Event]:
        """Every event of ``stream_id`` with its token payloads (``GET /v1/episodes/{id}``),
        in order; empty when it does not exist."""
        import datetime as dt

        from store.events import parse_event

        try:
            detail = self.request("GET", f"/v1/episodes/{stream_id}",
                                   params={"tokens": "true", "encoding": "json"})
        except errors.NotFoundError:
            return []
        return [parse_event(e["type"], e["data"], tokens=e.get("tokens") or None,
                            event_id=e["event_id"],
                            occurred_at=dt.datetime.fromisoformat(e["occurred_at"])
                            if e.get("occurred_at") else None, stored=True)
                for e in detail.get("events") or []]

    def run_config(self, run_id: str) -> RunConfig:
        return RunConfig.model_validate(self.request("GET", f"/v1/runs/{run_id}")["config"])

    def read_episode(self, episode_id: str) -> list[Event]:
        """Every event of an episode, with its token payloads (``GET /v1/episodes/{id}``),
        in stream order; ``NotFoundError`` naming it when there is no such episode."""
        from store.events import parse_event

        detail = self.request("GET", f"/v1/episodes/{episode_id}",
                               params={"tokens": "true", "encoding": "json"})
        return [parse_event(e["type"], e["data"], tokens=e.get("tokens") or None,
                            event_id=e["event_id"], stored=True)
                for e in detail.get("events") or []]

    def policy(self, run_id: str, version: int | None = None) -> PolicyState:
        run = self.request("GET", f"/v1/runs/{run_id}")
        newest = int(run.get("policy_version") or 0)
        if version is not None and version != newest:
            raise ValueError(f"run {run_id!r} serves policy version {newest}, not {version} "
                             "(through the API a rollout plays the newest version)")
        return PolicyState(newest, None)

    def policy_served(self, run_id: str, *, version: int, engine: str, backend: str,
                      source: str | None = None, load_seconds: float | None = None) -> None:
        self.request("POST", f"/v1/runs/{run_id}/served", json={
            "version": version, "engine": engine, "backend": backend, "source": source,
            "load_seconds": load_seconds})
