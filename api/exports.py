"""A run's data in the formats other tools read, for ``GET /v1/runs/{run}/export`` and
``trajstore export``.

Formats (:data:`FORMATS`):

- ``samples``: the run's samples as Parquet with verl's column names, one row per sample
  (:mod:`api.verl_columns`).
- ``verl-prompts``: a prompt dataset in the shape verl's ``RLHFDataset`` reads, as Parquet:
  one row per task of the run (episodes without a task id: per distinct prompt) with
  ``prompt`` (the chat messages ``{role, content}``), ``data_source``, ``reward_model``
  (``{"style": "rule", "ground_truth"}`` when the task's answer is known, else null) and
  ``extra_info`` (``index``, ``task_id``, ``group_id``, ``episode_id``, ``tools`` as JSON).
- ``verl-batch``: the run's rewarded samples as one padded batch in a safetensors file,
  under verl's names (see :func:`verl_batch`).
- ``atif``: one ATIF v1.7 trajectory (Harbor's Agent Trajectory Interchange Format) per
  finished episode, one JSON document per line.
- ``sft``: JSONL for supervised fine-tuning, one line per merged timeline of each finished
  episode whose reward reaches ``min_reward``: ``messages`` (the chat with its tool calls and
  tool results) and ``tools``.

:func:`prepare` checks every argument and builds the first chunk before it returns, so an
error is an ``ApiError`` raised before anything is written or sent.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import itertools
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np
import pyarrow as pa

from api import verl_columns
from api.errors import ApiError
from api.parquet import PARQUET_MEDIA_TYPE, stream_parquet
from store import queries
from store.eventlog import EventStore, RecordedEvent
from store.events import (
    AttemptFailed,
    EpisodeFinished,
    EpisodeStarted,
    LLMCalled,
    RewardAssigned,
    RolledBack,
    RunConfig,
    ToolReturned,
)
from store.stored_sample import StoredSample

__all__ = [
    "ATIF_SCHEMA_VERSION",
    "Export",
    "ExportFormat",
    "FORMATS",
    "PROMPTS_SCHEMA",
    "atif_trajectory",
    "prepare",
    "prepare_dataset",
    "prompt_row",
    "verl_batch",
    "verl_batch_tensors",
]

ExportFormat = Literal["samples", "verl-prompts", "verl-batch", "atif", "sft"]
FORMATS: tuple[str, ...] = get_args(ExportFormat)

ATIF_SCHEMA_VERSION = "ATIF-v1.7"
SAFETENSORS_MEDIA_TYPE = "application/octet-stream"
JSONL_MEDIA_TYPE = "application/x-ndjson"

_MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
PROMPTS_SCHEMA = pa.schema([
    ("prompt", pa.list_(_MESSAGE)),
    ("data_source", pa.string()),
    ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
    ("extra_info", pa.struct([("index", pa.int64()), ("task_id", pa.string()),
                              ("group_id", pa.string()), ("episode_id", pa.string()),
                              ("tools", pa.string())])),
])

#: Options each format takes besides the run (the others are refused when given).
_OPTIONS: dict[str, tuple[str, ...]] = {
    "samples": ("group_id", "kind", "status"),
    "verl-prompts": ("data_source",),
    "verl-batch": ("group_id", "kind", "status", "pad_token_id"),
    "atif": ("min_reward",),
    "sft": ("min_reward",),
}


@dataclass
class Export:
    """An export ready to write: its media type, a file name and the bytes, chunk by chunk
    (the first one already built)."""

    format: str
    media_type: str
    filename: str
    chunks: Iterator[bytes]


def _run_config(store: EventStore, run_id: str) -> RunConfig:
    record = queries.run_record(store, run_id)
    if record is None:
        raise ApiError(404, "not_found", f"no run {run_id!r}")
    return RunConfig.model_validate(record["data"].get("config", {}))


def _check_options(fmt: str, given: dict[str, Any]) -> None:
    if fmt not in FORMATS:
        raise ApiError(422, "invalid_request",
                       f"unknown export format {fmt!r}; known: {', '.join(FORMATS)}",
                       field="format")
    extra = sorted(k for k, v in given.items() if v is not None and k not in _OPTIONS[fmt])
    if extra:
        takes = ", ".join(_OPTIONS[fmt]) or "none"
        raise ApiError(422, "invalid_request",
                       f"format {fmt!r} does not take {', '.join(extra)} (it takes: {takes})",
                       field=extra[0])


def prepare(
    store: EventStore,
    run_id: str,
    fmt: str,
    *,
    group_id: str | None = None,
    kind: str | None = None,
    status: str | None = None,
    min_reward: float | None = None,
    data_source: str | None = None,
    pad_token_id: int | None = None,
    rows_per_group: int = 256,
    ground_truth: Callable[[str], Any] | None = None,
    tokenizer_loader: Callable[[str | None], Any] | None = None,
) -> Export:
    """The export of ``run_id`` in format ``fmt``. ``group_id``/``kind``/``status`` filter
    the samples (``samples``, ``verl-batch``); ``min_reward`` keeps episodes whose reward is
    at least that (``atif``, ``sft``); ``data_source`` names the prompts' source (the run id
    by default); ``pad_token_id`` pads ``verl-batch`` (the run tokenizer's pad token by
    default); ``ground_truth`` maps a task id to its answer (None when unknown) for
    ``verl-prompts``. Raises ApiError: 422 for an unknown format, an option the format does
    not take or a bad value, 404 for an unknown run (or no samples for ``verl-batch``), 409
    when the run's tokenizer is needed and not on this machine or an episode cannot be
    replayed."""
    _check_options(fmt, {"group_id": group_id, "kind": kind, "status": status,
                         "min_reward": min_reward, "data_source": data_source,
                         "pad_token_id": pad_token_id})
    if min_reward is not None and not np.isfinite(min_reward):
        raise ApiError(422, "invalid_request", f"min_reward must be a finite number, got "
                                               f"{min_reward}", field="min_reward")
    if pad_token_id is not None and pad_token_id < 0:
        raise ApiError(422, "invalid_request", f"pad_token_id must be >= 0, got "
                                               f"{pad_token_id}", field="pad_token_id")
    if data_source is not None and not data_source.strip():
        raise ApiError(422, "invalid_request", "data_source must not be empty",
                       field="data_source")
    if rows_per_group < 1:
        raise ValueError(f"rows_per_group must be >= 1, got {rows_per_group}")
    config = _run_config(store, run_id)
    filters = queries.SampleFilters(run_id=run_id, group_id=group_id, kind=kind, status=status)
    chunks: Iterator[bytes]
    matching = " matching the filters" if group_id or kind or status else ""
    episodes = f" with reward >= {min_reward:g}" if min_reward is not None else ""
    if fmt == "samples":
        batches: Iterator[Any] = (
            verl_columns.record_batch([verl_columns.from_row(r) for r in rows])
            for rows in queries.iter_samples(store, filters, chunk=rows_per_group))
        batches = _some(batches, f"run {run_id!r} has no samples{matching}")
        chunks = stream_parquet(batches, verl_columns.ARROW_SCHEMA)
        media, name = PARQUET_MEDIA_TYPE, f"{run_id}.parquet"
    elif fmt == "verl-prompts":
        table = _prompt_batches(store, run_id, data_source=data_source or run_id,
                                ground_truth=ground_truth, rows_per_group=rows_per_group)
        table = _some(table, f"run {run_id!r} has no episodes")
        chunks = stream_parquet(table, PROMPTS_SCHEMA)
        media, name = PARQUET_MEDIA_TYPE, f"{run_id}.prompts.parquet"
    elif fmt == "verl-batch":
        # Samples without a reward (their episode has none yet: status no_reward) are left
        # out: a score is never made up for them.
        samples = [sample for rows in queries.iter_samples(store, filters, chunk=rows_per_group)
                   for sample in map(verl_columns.from_row, rows)
                   if sample.reward is not None]
        if not samples:
            raise ApiError(404, "not_found", f"run {run_id!r} has no rewarded samples{matching}")
        if pad_token_id is None:
            pad_token_id = _pad_token_id(config, tokenizer_loader)
        chunks = iter([verl_batch(samples, pad_token_id=pad_token_id, run_id=run_id)])
        media, name = SAFETENSORS_MEDIA_TYPE, f"{run_id}.verl.safetensors"
    elif fmt == "atif":
        chunks = _lines(atif_trajectory(store.read_stream(row["episode_id"]), row=row,
                                        config=config)
                        for row in _some(_finished(store, run_id, min_reward),
                                         f"run {run_id!r} has no finished episode{episodes}"))
        media, name = JSONL_MEDIA_TYPE, f"{run_id}.atif.jsonl"
    else:  # sft
        rows = _some(_finished(store, run_id, min_reward),
                     f"run {run_id!r} has no finished episode{episodes}")
        chunks = _lines(_some((line for row in rows
                               for line in _sft_lines(store, row, tokenizer_loader)),
                              f"no finished episode of run {run_id!r}{episodes} gives an "
                              "SFT line: replay refused each (GET /v1/episodes/{id} says "
                              "why)"))
        media, name = JSONL_MEDIA_TYPE, f"{run_id}.sft.jsonl"
    # Build the first chunk now: an error (a tokenizer missing, an episode that cannot be
    # replayed) is then an answer, not a cut-off body.
    first = list(itertools.islice(chunks, 1))
    return Export(format=fmt, media_type=media, filename=name,
                  chunks=itertools.chain(first, chunks))


def _some(items: Iterable[Any], nothing: str) -> Iterator[Any]:
    """``items``, unless it is empty: then ApiError 404 saying ``nothing``, raised when the
    first item is asked for (``prepare`` asks before it returns). An export that selects
    nothing is an error, not an empty file."""
    iterator = iter(items)
    first = next(iterator, _NONE)
    if first is _NONE:
        raise ApiError(404, "not_found", nothing)
    yield first
    yield from iterator


_NONE = object()


# --- verl-prompts ------------------------------------------------------------------------

def _content(value: Any) -> str:
    """A message's content as text: a string as is, text parts joined, anything else as
    JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       for p in value):
        return "".join(str(p.get("text", "")) for p in value)
    return json.dumps(value, ensure_ascii=False)


def _prompt_key(data: dict[str, Any]) -> str:
    task_id = data.get("task_id")
    if task_id:
        return f"task:{task_id}"
    body = json.dumps([data.get("messages", []), data.get("tools", [])], sort_keys=True)
    return "prompt:" + hashlib.sha256(body.encode()).hexdigest()


def _ground_truth_text(value: Any) -> str | None:
    if value is None:
        return None
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False,
                                                           sort_keys=True)


def prompt_row(data: dict[str, Any], *, index: int, group_id: str, episode_id: str,
               data_source: str, ground_truth: Any = None) -> dict[str, Any]:
    """One row of the ``verl-prompts`` dataset (:data:`PROMPTS_SCHEMA`) from the data of an
    ``episode_started``; ``ground_truth`` (None when unknown) is written as text, JSON when
    it is not a string."""
    truth = _ground_truth_text(ground_truth)
    return {
        "prompt": [{"role": str(m.get("role", "")), "content": _content(m.get("content"))}
                   for m in data.get("messages", []) if isinstance(m, dict)],
        "data_source": data_source,
        "reward_model": ({"style": "rule", "ground_truth": truth} if truth is not None
                         else None),
        "extra_info": {"index": index, "task_id": data.get("task_id"),
                       "group_id": group_id, "episode_id": episode_id,
                       "tools": json.dumps(data.get("tools") or [], ensure_ascii=False)},
    }


def _prompt_rows(store: EventStore, run_id: str, *, data_source: str,
                 ground_truth: Callable[[str], Any] | None) -> Iterator[dict[str, Any]]:
    seen: set[str] = set()
    for rows in queries.iter_episode_starts(store, run_id):
        for row in rows:
            data = row["data"] or {}
            key = _prompt_key(data)
            if key in seen:
                continue
            seen.add(key)
            task_id = data.get("task_id")
            answer = ground_truth(task_id) if ground_truth is not None and task_id else None
            yield prompt_row(data, index=len(seen) - 1, group_id=row["group_id"],
                             episode_id=row["episode_id"], data_source=data_source,
                             ground_truth=answer)


def _prompt_batches(store: EventStore, run_id: str, *, data_source: str,
                    ground_truth: Callable[[str], Any] | None, rows_per_group: int
                    ) -> Iterator[pa.RecordBatch]:
    rows = _prompt_rows(store, run_id, data_source=data_source, ground_truth=ground_truth)
    while chunk := list(itertools.islice(rows, rows_per_group)):
        yield pa.RecordBatch.from_pylist(chunk, schema=PROMPTS_SCHEMA)


# --- verl-batch --------------------------------------------------------------------------

def _pad_token_id(config: RunConfig, loader: Callable[[str | None], Any] | None) -> int:
    from workers.engines.tokenizers import TokenizerNotFound, load_tokenizer

    name = config.tokenizer_name
    try:
        tokenizer = (loader or load_tokenizer)(name)
    except TokenizerNotFound as exc:
        raise ApiError(409, "tokenizer_not_found",
                       f"{exc}; give pad_token_id to export without it") from None
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
        else tokenizer.eos_token_id
    if pad is None:
        raise ApiError(409, "no_pad_token", f"tokenizer {name!r} has neither a pad nor an "
                                            "end-of-sequence token; give pad_token_id")
    return int(pad)


def verl_batch_tensors(samples: Sequence[StoredSample], *, pad_token_id: int
                       ) -> tuple[dict[str, np.ndarray], list[str]]:
    """The samples as verl's padded batch, and the group ids ``uid`` indexes.

    Prompts are left-padded to the longest prompt ``P`` and responses right-padded to the
    longest response ``R``, as verl's rollout does (padding holds ``pad_token_id`` and has
    attention 0). Arrays, ``N`` samples: ``prompts`` ``(N, P)``, ``responses`` ``(N, R)``,
    ``input_ids``/``attention_mask``/``position_ids`` ``(N, P + R)`` (positions count the
    attended tokens from 0, 0 on left padding), ``response_mask`` ``(N, R)`` (1 on tokens
    the model sampled, the loss mask), ``rollout_log_probs`` ``(N, R)`` (float32, 0 off
    the mask), ``token_level_scores`` ``(N, R)`` (float32: the sample's reward on its last
    response token, 0 elsewhere; ``prepare`` leaves samples without a reward out), ``uid``
    ``(N,)``
    (index into the returned group ids), ``sample_id`` ``(N,)`` and ``is_negative``
    ``(N,)``. Integer arrays are int64."""
    n = len(samples)
    p_len = max((s.prompt_length for s in samples), default=0)
    r_len = max((len(s.token_ids) - s.prompt_length for s in samples), default=0)
    prompts = np.full((n, p_len), pad_token_id, dtype=np.int64)
    responses = np.full((n, r_len), pad_token_id, dtype=np.int64)
    prompt_attention = np.zeros((n, p_len), dtype=np.int64)
    response_attention = np.zeros((n, r_len), dtype=np.int64)
    response_mask = np.zeros((n, r_len), dtype=np.int64)
    logprobs = np.zeros((n, r_len), dtype=np.float32)
    scores = np.zeros((n, r_len), dtype=np.float32)
    uids: list[str] = []
    uid_index: dict[str, int] = {}
    uid = np.zeros(n, dtype=np.int64)
    for i, s in enumerate(samples):
        p = s.prompt_length
        r = len(s.token_ids) - p
        if p:
            prompts[i, p_len - p:] = s.prompt_ids
            prompt_attention[i, p_len - p:] = 1
        responses[i, :r] = s.response_ids
        response_attention[i, :r] = 1
        response_mask[i, :r] = s.response_mask
        logprobs[i, :r] = np.where(s.response_mask > 0, s.rollout_logprobs, 0.0)
        if r and s.reward is not None:
            scores[i, r - 1] = s.reward
        uid[i] = uid_index.setdefault(s.uid, len(uids))
        if uid[i] == len(uids):
            uids.append(s.uid)
    attention = np.concatenate([prompt_attention, response_attention], axis=1)
    positions = np.clip(np.cumsum(attention, axis=1) - 1, 0, None).astype(np.int64)
    return {
        "input_ids": np.concatenate([prompts, responses], axis=1),
        "attention_mask": attention,
        "position_ids": positions,
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "rollout_log_probs": logprobs,
        "token_level_scores": scores,
        "uid": uid,
        "sample_id": np.array([s.sample_id for s in samples], dtype=np.int64),
        "is_negative": np.array([s.is_negative for s in samples], dtype=np.bool_),
    }, uids


def verl_batch(samples: Sequence[StoredSample], *, pad_token_id: int, run_id: str) -> bytes:
    """The samples as a safetensors file of :func:`verl_batch_tensors`' arrays. Its metadata
    (strings) holds ``format`` (``trajstore-verl-batch``), ``run_id``, ``pad_token_id``,
    ``uids`` (a JSON list: ``uids[uid[i]]`` is sample ``i``'s group id) and ``episode_ids``
    (a JSON list, one per sample). ``safetensors.torch.load_file`` reads it."""
    from safetensors.numpy import save

    tensors, uids = verl_batch_tensors(samples, pad_token_id=pad_token_id)
    metadata = {"format": "trajstore-verl-batch", "run_id": run_id,
                "pad_token_id": str(pad_token_id), "uids": json.dumps(uids),
                "episode_ids": json.dumps([s.episode_id for s in samples])}
    return save(tensors, metadata=metadata)


# --- episodes: atif and sft --------------------------------------------------------------

def _finished(store: EventStore, run_id: str, min_reward: float | None
              ) -> Iterator[dict[str, Any]]:
    for rows in queries.iter_episode_starts(store, run_id, finished_only=True,
                                            min_reward=min_reward):
        yield from rows


def _lines(items: Iterable[dict[str, Any]]) -> Iterator[bytes]:
    for item in items:
        yield (json.dumps(item, ensure_ascii=False, allow_nan=False) + "\n").encode()


def _time(value: dt.datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _arguments(call: dict[str, Any]) -> Any:
    function = call.get("function") or {}
    args = function.get("arguments", call.get("arguments", {}))
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return {"_raw": args}
    return args


def _atif_tool_calls(response: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for i, call in enumerate(response.get("tool_calls") or []):
        if not isinstance(call, dict):
            continue
        function = call.get("function") or {}
        out.append({"tool_call_id": str(call.get("id") or f"call_{i}"),
                    "function_name": str(function.get("name", call.get("name", ""))),
                    "arguments": _arguments(call)})
    return out


_SOURCES = {"system": "system", "developer": "system", "user": "user", "assistant": "agent"}


def atif_trajectory(records: Sequence[RecordedEvent], *, row: dict[str, Any] | None = None,
                    config: RunConfig | None = None) -> dict[str, Any]:
    """One episode's events as an ATIF v1.7 trajectory: the task's messages as
    ``system``/``user`` steps, each ``llm_called`` as an ``agent`` step (its message,
    reasoning, tool calls and metrics with the prompt and completion token ids and the
    logprobs), each ``tool_returned`` as a result in the ``observation`` of the step whose
    tool call it answers. A call later rolled back or failed is kept and says so in its
    step's ``extra``; the reward and status are in the trajectory's ``extra``."""
    if not records or not isinstance(records[0].event, EpisodeStarted):
        raise ValueError("an episode stream begins with episode_started")
    started = records[0].event
    episode_id = records[0].stream_id
    steps: list[dict[str, Any]] = []
    by_call: dict[str, dict[str, Any]] = {}
    by_tool_call: dict[str, dict[str, Any]] = {}
    reward: float | None = None
    components: dict[str, float] = {}
    status = reason = None
    agents: set[str] = set()

    def add(step: dict[str, Any]) -> dict[str, Any]:
        step = {"step_id": len(steps) + 1, **step}
        steps.append(step)
        return step

    for message in started.messages:
        role = str(message.get("role", "user"))
        add({"timestamp": _time(records[0].recorded_at),
             "source": _SOURCES.get(role, "system"),
             "message": _content(message.get("content")),
             **({"extra": {"role": role}} if role not in _SOURCES else {})})
    for r in records[1:]:
        event = r.event
        when = _time(event.occurred_at or r.recorded_at)
        if isinstance(event, LLMCalled):
            agents.add(event.agent)
            response = event.response or {}
            tool_calls = _atif_tool_calls(response)
            step: dict[str, Any] = {
                "timestamp": when, "source": "agent",
                "message": _content(response.get("content")),
            }
            reasoning = response.get("reasoning_content") or response.get("reasoning")
            if reasoning:
                step["reasoning_content"] = _content(reasoning)
            model = config.model if config is not None else None
            if model:
                step["model_name"] = model
            if tool_calls:
                step["tool_calls"] = tool_calls
            step["metrics"] = {
                "prompt_tokens": int(len(event.prompt_ids)),
                "completion_tokens": int(len(event.response_ids)),
                "prompt_token_ids": [int(t) for t in event.prompt_ids],
                "completion_token_ids": [int(t) for t in event.response_ids],
                "logprobs": [float(x) for x in event.logprobs],
            }
            step["extra"] = {"agent": event.agent, "call_id": event.call_id,
                             "policy_version": event.policy_version,
                             "finish_reason": event.finish_reason}
            step = add(step)
            by_call[event.call_id] = step
            for call in tool_calls:
                by_tool_call[call["tool_call_id"]] = step
        elif isinstance(event, ToolReturned):
            owner = by_tool_call.get(event.tool_call_id or "")
            result = {"source_call_id": event.tool_call_id if owner is not None else None,
                      "content": event.output}
            if owner is None:  # a tool run outside the model's tool calls
                owner = add({"timestamp": when, "source": "system",
                             "message": f"tool {event.name} returned"})
            owner.setdefault("observation", {"results": []})["results"].append(result)
            if event.is_error:
                owner.setdefault("extra", {}).setdefault("tool_errors", []).append({
                    "tool_call_id": event.tool_call_id, "name": event.name,
                    "error_type": event.error_type, "error_message": event.error_message})
        elif isinstance(event, AttemptFailed):
            failed = by_call.get(event.failed_call_id or "")
            if failed is not None:
                failed.setdefault("extra", {})["attempt_failed"] = {
                    "checkpoint_id": event.checkpoint_id, "position_key": event.position_key,
                    "retry_index": event.retry_index, "error_types": event.error_types,
                    "error_messages": event.error_messages}
        elif isinstance(event, RolledBack):
            for call_id in event.discarded_call_ids:
                if call_id in by_call:
                    by_call[call_id].setdefault("extra", {})["rolled_back"] = True
        elif isinstance(event, RewardAssigned):
            reward, components = float(event.value), dict(event.components)
        elif isinstance(event, EpisodeFinished):
            status, reason = event.status, event.reason
    agent_steps = [s for s in steps if s["source"] == "agent" and "metrics" in s]
    agent: dict[str, Any] = {"name": ",".join(sorted(agents)) or "main",
                             "version": "unknown"}
    if config is not None and (config.model or config.tokenizer):
        agent["model_name"] = config.model or config.tokenizer
    if started.tools:
        agent["tool_definitions"] = [dict(t) for t in started.tools]
    return {
        "schema_version": ATIF_SCHEMA_VERSION,
        "session_id": episode_id,
        "agent": agent,
        "steps": steps,
        "final_metrics": {
            "total_prompt_tokens": sum(s["metrics"]["prompt_tokens"] for s in agent_steps),
            "total_completion_tokens": sum(s["metrics"]["completion_tokens"]
                                           for s in agent_steps),
            "total_steps": len(steps),
        },
        "extra": {"run_id": started.run_id, "group_id": started.group_id,
                  "task_id": started.task_id, "policy_version": started.policy_version,
                  "reward": reward, "reward_components": components, "status": status,
                  "reason": reason,
                  **({"started_at": _time(row["started_at"])} if row else {})},
    }


def _sft_lines(store: EventStore, row: dict[str, Any],
               tokenizer_loader: Callable[[str | None], Any] | None
               ) -> Iterator[dict[str, Any]]:
    """One line per surviving merged timeline of the episode, leaving out timelines of calls
    that failed or were rolled back: the call's request messages and its reply. Calls with
    token ids survive as replay merges them; calls recorded without (OTLP spans, a server
    that returns none) from their messages alone, merged at text level, as replay merges
    text (``text_survivors``)."""
    from api.timelines import replay_stored

    kwargs = {"tokenizer_loader": tokenizer_loader} if tokenizer_loader is not None else {}
    try:
        replay = replay_stored(store, row["episode_id"], **kwargs)
    except ApiError as exc:
        if exc.code == "not_replayable":  # it gives no training samples either
            return
        raise
    calls = {r.event.call_id: r.event for r in replay.records
             if isinstance(r.event, LLMCalled)}
    dropped: set[str] = set()
    for r in replay.records:
        if isinstance(r.event, RolledBack):
            dropped.update(r.event.discarded_call_ids)
        elif isinstance(r.event, AttemptFailed) and r.event.failed_call_id:
            dropped.add(r.event.failed_call_id)
    started = replay.records[0].event
    result = replay.result
    untokenized = [calls[c] for c in result.untokenized_calls if c not in dropped]
    kept = {result.call_ids[i] for i in result.survivor_indices} | {
        call.call_id for call in text_survivors(untokenized)}
    for call_id, call in calls.items():  # in recording order
        if call_id not in kept or call_id in dropped:
            continue
        yield {
            "messages": [*(dict(m) for m in call.messages),
                         {"role": "assistant", **call.response}],
            "tools": list(call.tools if call.tools is not None
                          else started.tools),  # type: ignore[attr-defined]
            "run_id": result.run_id, "episode_id": row["episode_id"],
            "group_id": result.group_id,
            "task_id": started.task_id,  # type: ignore[attr-defined]
            "agent": call.agent, "reward": row["reward"], "status": row["status"],
        }


def text_survivors(calls: Sequence[LLMCalled]) -> list[LLMCalled]:
    """Of ``calls`` (in recording order), those whose history (request messages and reply)
    no longer call of the same agent extends: the timelines replay keeps when it merges at
    text level (role, content and tool calls equal), decided from the messages alone."""
    from workers.replay.equality import content_text
    from workers.replay.timeline import LLM_AUTHOR, Message, Timeline, plan_merge

    def message(m: dict[str, Any], author: str) -> Message:
        return Message(role=str(m.get("role") or "user"), author=author,
                       text=content_text(m.get("content")), token_ids=[], logprobs=None,
                       tool_calls=m.get("tool_calls") or None)

    timelines = [Timeline(agent=call.agent, messages=[
        *(message(m, "env") for m in call.messages),
        message({"role": "assistant", **call.response}, LLM_AUTHOR)]) for call in calls]
    return [calls[i] for i in plan_merge(timelines).survivors]


# --- a dataset version -------------------------------------------------------------------

#: Options each format takes when exporting a dataset version (its rows have no status).
_DATASET_OPTIONS: dict[str, tuple[str, ...]] = {
    fmt: tuple(o for o in options if o != "status") for fmt, options in _OPTIONS.items()}


def _dataset_samples(store: EventStore, version: Any, *, group_id: str | None,
                     kind: str | None) -> list[StoredSample]:
    """The version's rows as samples, in row order, with the rewards the rules gave. A row
    whose sample the run's projection holds (same episode, kind and timeline index) takes
    that sample's id and policy version, so the export matches the run's export of the same
    samples; other rows take their row index as id."""
    from store.datasets import read_rows

    rows = read_rows(store.db, version.dataset_id)
    with store.db.connection() as conn:
        known = {(e, k, t): (sid, pv) for sid, e, k, t, pv in conn.execute(
            "SELECT sample_id, episode_id, kind, timeline_index, policy_version FROM samples"
            " WHERE run_id = ANY(%s)", (list(version.run_ids),)).fetchall()}
    out = []
    for index, row in enumerate(rows):
        if (group_id is not None and row.group_id != group_id) or (
                kind is not None and row.kind != kind):
            continue
        sample_id, policy_version = known.get(row.key, (index, None))
        mask = np.asarray(row.loss_mask, dtype=np.uint8)
        out.append(StoredSample(
            sample_id=sample_id, run_id=row.run_id, group_id=row.group_id,
            episode_id=row.episode_id, agent=row.agent, kind=row.kind, reward=row.reward,
            policy_version=policy_version, prompt_length=row.prompt_length,
            token_ids=row.token_ids, loss_mask=mask, logprobs=row.logprobs,
            num_trainable=int(np.count_nonzero(mask)), error_types=row.error_types))
    return out


def _dataset_episodes(store: EventStore, version: Any, *, finished_only: bool,
                      min_reward: float | None) -> Iterator[dict[str, Any]]:
    """The version's episodes as the run exports list them (start order, run by run), each
    with the reward the rules gave it (its positive rows'), filtered by ``min_reward`` on
    that reward."""
    from store.datasets import read_row_summaries

    rewards: dict[str, float | None] = {}
    for row in read_row_summaries(store.db, version.dataset_id):
        if row["kind"] == "positive":
            rewards[row["episode_id"]] = row["reward"]
        else:
            rewards.setdefault(row["episode_id"], None)
    for run_id in version.run_ids:
        for rows in queries.iter_episode_starts(store, run_id, finished_only=finished_only):
            for row in rows:
                if row["episode_id"] not in rewards:
                    continue
                given = rewards[row["episode_id"]]
                if given is not None:
                    row = {**row, "reward": given}
                if min_reward is not None and (row["reward"] is None
                                               or row["reward"] < min_reward):
                    continue
                yield row


def prepare_dataset(
    store: EventStore,
    version: Any,
    fmt: str,
    *,
    group_id: str | None = None,
    kind: str | None = None,
    min_reward: float | None = None,
    data_source: str | None = None,
    pad_token_id: int | None = None,
    rows_per_group: int = 256,
    ground_truth: Callable[[str], Any] | None = None,
    tokenizer_loader: Callable[[str | None], Any] | None = None,
) -> Export:
    """The export of a dataset version (``store.datasets.DatasetVersion``) in format
    ``fmt``, built as :func:`prepare` builds a run's: ``samples`` and ``verl-batch`` from
    its rows (with the rewards its rules gave), ``verl-prompts``, ``atif`` and ``sft`` from
    its episodes' logs (``min_reward`` and the ``reward`` they carry: the version's). A
    version derived from one run under rules that keep every sample and the recorded reward
    exports to the same bytes as that run. The file is named ``NAME@VERSION``; for a
    version of several runs ``run_id`` (verl-batch) and the default ``data_source`` are
    ``NAME@VERSION``. Raises ApiError as :func:`prepare` does (``status`` is refused: a
    version's rows have none)."""
    if fmt in _DATASET_OPTIONS:
        extra = [k for k, v in (("group_id", group_id), ("kind", kind),
                                ("min_reward", min_reward), ("data_source", data_source),
                                ("pad_token_id", pad_token_id))
                 if v is not None and k not in _DATASET_OPTIONS[fmt]]
        if extra:
            raise ApiError(422, "invalid_request",
                           f"format {fmt!r} does not take {', '.join(extra)} (it takes: "
                           f"{', '.join(_DATASET_OPTIONS[fmt])})", field=extra[0])
    _check_options(fmt, {"group_id": group_id, "kind": kind, "min_reward": min_reward,
                         "data_source": data_source, "pad_token_id": pad_token_id})
    if min_reward is not None and not np.isfinite(min_reward):
        raise ApiError(422, "invalid_request", f"min_reward must be a finite number, got "
                                               f"{min_reward}", field="min_reward")
    if pad_token_id is not None and pad_token_id < 0:
        raise ApiError(422, "invalid_request", f"pad_token_id must be >= 0, got "
                                               f"{pad_token_id}", field="pad_token_id")
    if data_source is not None and not data_source.strip():
        raise ApiError(422, "invalid_request", "data_source must not be empty",
                       field="data_source")
    if rows_per_group < 1:
        raise ValueError(f"rows_per_group must be >= 1, got {rows_per_group}")
    ref = f"{version.name}@{version.version}"
    source = version.run_ids[0] if len(version.run_ids) == 1 else ref
    config = _run_config(store, version.run_ids[0])
    matching = " matching the filters" if group_id or kind else ""
    episodes = f" with reward >= {min_reward:g}" if min_reward is not None else ""
    chunks: Iterator[bytes]
    if fmt in ("samples", "verl-batch"):
        samples = _dataset_samples(store, version, group_id=group_id, kind=kind)
        if not samples:
            raise ApiError(404, "not_found", f"dataset {ref} has no rows{matching}")
        if fmt == "samples":
            batches = (verl_columns.record_batch(samples[i:i + rows_per_group])
                       for i in range(0, len(samples), rows_per_group))
            chunks = stream_parquet(batches, verl_columns.ARROW_SCHEMA)
            media, name = PARQUET_MEDIA_TYPE, f"{ref}.parquet"
        else:
            if pad_token_id is None:
                pad_token_id = _pad_token_id(config, tokenizer_loader)
            chunks = iter([verl_batch(samples, pad_token_id=pad_token_id, run_id=source)])
            media, name = SAFETENSORS_MEDIA_TYPE, f"{ref}.verl.safetensors"
    elif fmt == "verl-prompts":
        rows = _dataset_episodes(store, version, finished_only=False, min_reward=None)
        chosen = _prompt_rows_of(rows, data_source=data_source or source,
                                 ground_truth=ground_truth)
        batches = (pa.RecordBatch.from_pylist(chunk, schema=PROMPTS_SCHEMA)
                   for chunk in iter(lambda: list(itertools.islice(chosen, rows_per_group)),
                                     []))
        chunks = stream_parquet(_some(batches, f"dataset {ref} has no episodes"),
                                PROMPTS_SCHEMA)
        media, name = PARQUET_MEDIA_TYPE, f"{ref}.prompts.parquet"
    elif fmt == "atif":
        chunks = _lines(atif_trajectory(store.read_stream(row["episode_id"]), row=row,
                                        config=config)
                        for row in _some(_dataset_episodes(store, version, finished_only=True,
                                                           min_reward=min_reward),
                                         f"dataset {ref} has no finished episode{episodes}"))
        media, name = JSONL_MEDIA_TYPE, f"{ref}.atif.jsonl"
    else:  # sft
        finished = _some(_dataset_episodes(store, version, finished_only=True,
                                           min_reward=min_reward),
                         f"dataset {ref} has no finished episode{episodes}")
        chunks = _lines(_some((line for row in finished
                               for line in _sft_lines(store, row, tokenizer_loader)),
                              f"no finished episode of dataset {ref}{episodes} gives an SFT "
                              "line: replay refused each"))
        media, name = JSONL_MEDIA_TYPE, f"{ref}.sft.jsonl"
    first = list(itertools.islice(chunks, 1))
    return Export(format=fmt, media_type=media, filename=name,
                  chunks=itertools.chain(first, chunks))


def _prompt_rows_of(rows: Iterable[dict[str, Any]], *, data_source: str,
                    ground_truth: Callable[[str], Any] | None) -> Iterator[dict[str, Any]]:
    """:func:`_prompt_rows` over the given episode rows."""
    seen: set[str] = set()
    for row in rows:
        data = row["data"] or {}
        key = _prompt_key(data)
        if key in seen:
            continue
        seen.add(key)
        task_id = data.get("task_id")
        answer = ground_truth(task_id) if ground_truth is not None and task_id else None
        yield prompt_row(data, index=len(seen) - 1, group_id=row["group_id"],
                         episode_id=row["episode_id"], data_source=data_source,
                         ground_truth=answer)
