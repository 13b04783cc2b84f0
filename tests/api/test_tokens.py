"""Token payload codecs, verl columns and Parquet streaming, each vectorised function checked
against a plain loop reference on seeded random data."""

from __future__ import annotations

import base64
import io
import struct

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from api.parquet import parquet_bytes, stream_parquet
from api.tokens import decode_array, decode_event_tokens, encode_array
from api.verl_columns import ARROW_SCHEMA, VerlSample, record_batch, to_json
from store.errors import ValidationError


def loop_decode(text: str, fmt: str) -> list[float | int]:
    """Reference: unpack little-endian items one at a time."""
    raw = base64.b64decode(text)
    size = struct.calcsize("<" + fmt)
    return [struct.unpack("<" + fmt, raw[i:i + size])[0] for i in range(0, len(raw), size)]


def loop_encode(values: list[float | int], fmt: str) -> str:
    return base64.b64encode(b"".join(struct.pack("<" + fmt, v) for v in values)).decode()


@pytest.mark.parametrize("seed", range(5))
def test_base64_codec_matches_a_loop_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 2**31 - 1, rng.integers(0, 300)).astype(np.int32)
    logprobs = (-rng.exponential(1.0, rng.integers(0, 300))).astype(np.float32)
    ids_text = encode_array(ids, dtype="<i4", encoding="base64")
    lp_text = encode_array(logprobs, dtype="<f4", encoding="base64")
    assert ids_text == loop_encode(ids.tolist(), "i")
    assert lp_text == loop_encode(logprobs.tolist(), "f")
    assert decode_array(ids_text, dtype="<i4", field="x").tolist() == loop_decode(ids_text, "i")
    assert decode_array(lp_text, dtype="<f4", field="x").tolist() == loop_decode(lp_text, "f")
    assert encode_array(ids, dtype="<i4", encoding="json") == ids.tolist()


def test_decode_refuses_bad_payloads() -> None:
    with pytest.raises(ValueError, match="prompt_ids is a string but not valid base64"):
        decode_array("@@@", dtype="<i4", field="prompt_ids")
    with pytest.raises(ValueError, match="holds 6 bytes, not a multiple of 4"):
        decode_array(base64.b64encode(b"123456").decode(), dtype="<i4", field="x")
    with pytest.raises(TypeError, match="must be a JSON array or a base64 string, got dict"):
        decode_array({"a": 1}, dtype="<i4", field="x")
    with pytest.raises(ValueError, match="encoding must be 'json' or 'base64'"):
        encode_array([1], dtype="<i4", encoding="hex")  # type: ignore[arg-type]
    with pytest.raises(ValidationError) as exc:
        decode_event_tokens({"type": "llm_called", "logprobs": "%%%"}, 7)
    assert exc.value.event_index == 7 and exc.value.field == "logprobs"
    plain = {"type": "llm_called", "prompt_ids": [1, 2]}
    assert decode_event_tokens(plain, 0) is plain


def _samples(rng: np.random.Generator, n: int) -> list[VerlSample]:
    out = []
    for i in range(n):
        length = int(rng.integers(1, 50))
        prompt = int(rng.integers(0, length + 1))
        mask = np.zeros(length, np.uint8)
        mask[prompt:] = rng.integers(0, 2, length - prompt)
        out.append(VerlSample(
            sample_id=i, run_id="r", group_id=f"g{i % 3}", episode_id=f"e{i}", agent="main",
            kind="negative" if i % 4 == 0 else "positive",
            reward=None if i == 1 else float(rng.normal()),
            policy_version=None if i == 2 else i, prompt_length=prompt,
            token_ids=rng.integers(0, 150_000, length).astype(np.int32), loss_mask=mask,
            logprobs=(-rng.random(length) * mask).astype(np.float32)))
    return out


def loop_record_batch(samples: list[VerlSample]) -> pa.RecordBatch:
    """Reference: the same columns built from Python lists, row by row."""
    rows: dict[str, list[object]] = {name: [] for name in ARROW_SCHEMA.names}
    for s in samples:
        p = s.prompt_length
        row = {"sample_id": s.sample_id, "uid": s.uid, "episode_id": s.episode_id,
               "agent": s.agent, "kind": s.kind, "is_negative": s.kind == "negative",
               "reward": s.reward, "policy_version": s.policy_version,
               "prompt_ids": [int(x) for x in s.token_ids[:p]],
               "response_ids": [int(x) for x in s.token_ids[p:]],
               "response_mask": [int(x) for x in s.loss_mask[p:]],
               "rollout_log_probs": [float(x) for x in s.logprobs[p:]]}
        for name, value in row.items():
            rows[name].append(value)
    return pa.RecordBatch.from_pydict(rows, schema=ARROW_SCHEMA)


@pytest.mark.parametrize("seed", range(4))
def test_record_batch_matches_a_loop_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    samples = _samples(rng, int(rng.integers(0, 20)))
    assert record_batch(samples).equals(loop_record_batch(samples))
    for s in samples:
        js = to_json(s, encoding="json")
        assert js["prompt_ids"] + js["response_ids"] == s.token_ids.tolist()
        assert js["is_negative"] == (s.kind == "negative")


def test_stream_parquet_writes_one_row_group_per_batch() -> None:
    rng = np.random.default_rng(9)
    batches = [record_batch(_samples(rng, 5)) for _ in range(3)]
    chunks = list(stream_parquet(batches, ARROW_SCHEMA))
    assert len(chunks) == 4  # three row groups, then the footer
    f = pq.ParquetFile(io.BytesIO(b"".join(chunks)))
    assert f.metadata.num_row_groups == 3 and f.metadata.num_rows == 15
    empty = pq.read_table(io.BytesIO(parquet_bytes([], ARROW_SCHEMA)))
    assert empty.num_rows == 0 and empty.schema.equals(ARROW_SCHEMA)
    other = pa.record_batch([pa.array([1])], names=["x"])
    with pytest.raises(ValueError, match="batch schema"):
        list(stream_parquet([other], ARROW_SCHEMA))
