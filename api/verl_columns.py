"""The verl column set of a sample, built from a ``samples`` row or a leased sample, as JSON
fields or as Arrow record batches (one batch becomes one Parquet row group).

Columns: ``sample_id``, ``uid`` (the GRPO group), ``episode_id``, ``agent``, ``kind``,
``is_negative``, ``reward``, ``policy_version``, and per sample the token lists
``prompt_ids`` (int32), ``response_ids`` (int32), ``response_mask`` (int8, 1 where trained)
and ``rollout_log_probs`` (float32, 0 where not sampled). Shapes: ``prompt_ids``
``(prompt_length,)``, the other three ``(response_length,)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from api.tokens import Encoding, encode_array

__all__ = ["ARROW_SCHEMA", "VerlSample", "from_leased", "from_row", "record_batch", "to_json"]

ARROW_SCHEMA = pa.schema([
    ("sample_id", pa.int64()),
    ("uid", pa.string()),
    ("episode_id", pa.string()),
    ("agent", pa.string()),
    ("kind", pa.string()),
    ("is_negative", pa.bool_()),
    ("reward", pa.float64()),
    ("policy_version", pa.int32()),
    ("prompt_ids", pa.list_(pa.int32())),
    ("response_ids", pa.list_(pa.int32())),
    ("response_mask", pa.list_(pa.int8())),
    ("rollout_log_probs", pa.list_(pa.float32())),
])


@dataclass(frozen=True)
class VerlSample:
    """One sample in verl's terms. Arrays: ``token_ids``/``loss_mask``/``logprobs`` shape
    ``(num_tokens,)``; the prompt is the first ``prompt_length`` tokens."""

    sample_id: int
    uid: str
    episode_id: str
    agent: str
    kind: str
    reward: float | None
    policy_version: int | None
    prompt_length: int
    token_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    status: str | None = None
    num_trainable: int | None = None
    error_types: Sequence[str] | None = None
    error_messages: Sequence[str] | None = None

    @property
    def is_negative(self) -> bool:
        return self.kind == "negative"


def from_row(row: dict[str, Any]) -> VerlSample:
    """A sample from a ``samples`` row read with ``store.queries`` (token columns as bytes)."""
    ids = np.frombuffer(row["token_ids"], dtype="<i4") if "token_ids" in row else None
    return VerlSample(
        sample_id=row["sample_id"], uid=row["group_id"], episode_id=row["episode_id"],
        agent=row["agent"], kind=row["kind"], reward=row["reward"],
        policy_version=row["policy_version"], prompt_length=row["prompt_length"],
        token_ids=ids if ids is not None else np.zeros(row["num_tokens"], dtype=np.int32),
        loss_mask=np.frombuffer(row["loss_mask"], dtype=np.uint8) if ids is not None
        else np.zeros(0, dtype=np.uint8),
        logprobs=np.frombuffer(row["logprobs"], dtype="<f4") if ids is not None
        else np.zeros(0, dtype=np.float32),
        status=row.get("status"), num_trainable=row.get("num_trainable"),
        error_types=row.get("error_types"), error_messages=row.get("error_messages"),
    )


def from_leased(sample: Any) -> VerlSample:
    """A sample from a ``store.leasing.LeasedSample``."""
    return VerlSample(
        sample_id=sample.sample_id, uid=sample.group_id, episode_id=sample.episode_id,
        agent=sample.agent, kind=sample.kind, reward=sample.reward,
        policy_version=sample.policy_version, prompt_length=sample.prompt_length,
        token_ids=sample.token_ids, loss_mask=sample.loss_mask, logprobs=sample.logprobs,
        status="leased", num_trainable=int(np.count_nonzero(sample.loss_mask)),
    )


def to_json(sample: VerlSample, *, encoding: Encoding, tokens: bool = True) -> dict[str, Any]:
    """The sample as the JSON fields of ``SampleOut`` (token columns in ``encoding``)."""
    out: dict[str, Any] = {
        "sample_id": sample.sample_id, "uid": sample.uid, "episode_id": sample.episode_id,
        "agent": sample.agent, "kind": sample.kind, "is_negative": sample.is_negative,
        "status": sample.status, "reward": sample.reward,
        "policy_version": sample.policy_version, "prompt_length": sample.prompt_length,
        "num_tokens": int(len(sample.token_ids)), "num_trainable": sample.num_trainable,
        "error_types": list(sample.error_types) if sample.error_types is not None else None,
        "error_messages": (list(sample.error_messages) if sample.error_messages is not None
                           else None),
    }
    if tokens:
        p = sample.prompt_length
        out["prompt_ids"] = encode_array(sample.token_ids[:p], dtype="<i4", encoding=encoding)
        out["response_ids"] = encode_array(sample.token_ids[p:], dtype="<i4", encoding=encoding)
        out["response_mask"] = encode_array(sample.loss_mask[p:], dtype="u1", encoding=encoding)
        out["rollout_log_probs"] = encode_array(sample.logprobs[p:], dtype="<f4",
                                                encoding=encoding)
    return out


def _lists(parts: list[np.ndarray], value_type: pa.DataType, dtype: str) -> pa.Array:
    lengths = np.fromiter((len(a) for a in parts), dtype=np.int64, count=len(parts))
    offsets = np.zeros(len(parts) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = (np.concatenate(parts).astype(dtype, copy=False) if parts
              else np.zeros(0, dtype=dtype))
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()),
                                    pa.array(values, value_type))


def record_batch(samples: Sequence[VerlSample]) -> pa.RecordBatch:
    """The samples as one Arrow record batch of ``ARROW_SCHEMA``."""
    prompt = [s.token_ids[: s.prompt_length] for s in samples]
    response = [s.token_ids[s.prompt_length:] for s in samples]
    mask = [s.loss_mask[s.prompt_length:] for s in samples]
    logp = [s.logprobs[s.prompt_length:] for s in samples]
    return pa.RecordBatch.from_arrays([
        pa.array([s.sample_id for s in samples], pa.int64()),
        pa.array([s.uid for s in samples], pa.string()),
        pa.array([s.episode_id for s in samples], pa.string()),
        pa.array([s.agent for s in samples], pa.string()),
        pa.array([s.kind for s in samples], pa.string()),
        pa.array([s.is_negative for s in samples], pa.bool_()),
        pa.array([s.reward for s in samples], pa.float64()),
        pa.array([s.policy_version for s in samples], pa.int32()),
        _lists(prompt, pa.int32(), "int32"),
        _lists(response, pa.int32(), "int32"),
        _lists(mask, pa.int8(), "int8"),
        _lists(logp, pa.float32(), "float32"),
    ], schema=ARROW_SCHEMA)
