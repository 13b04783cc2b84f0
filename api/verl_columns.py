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
from typing import Any

import numpy as np
import pyarrow as pa

from api.tokens import Encoding, encode_array
from store import stored_sample
from store.codec import ID_DTYPE, LOGPROB_DTYPE
from store.stored_sample import StoredSample

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


# The API reads the store's one sample type; the name says which columns it is shown in.
VerlSample = StoredSample


def from_row(row: dict[str, Any]) -> VerlSample:
    """A sample from a ``samples`` row read with ``store.queries`` (token columns as bytes)."""
    return stored_sample.from_row(row)


def from_leased(sample: StoredSample) -> VerlSample:
    """A sample of a ``store.leasing.Lease`` (already a ``StoredSample``)."""
    return sample


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
        out["prompt_ids"] = encode_array(sample.token_ids[:p], dtype=ID_DTYPE, encoding=encoding)
        out["response_ids"] = encode_array(sample.token_ids[p:], dtype=ID_DTYPE, encoding=encoding)
        out["response_mask"] = encode_array(sample.loss_mask[p:], dtype="u1", encoding=encoding)
        out["rollout_log_probs"] = encode_array(sample.logprobs[p:], dtype=LOGPROB_DTYPE,
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
