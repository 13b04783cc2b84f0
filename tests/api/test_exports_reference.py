"""The verl exports against what verl 0.9.1 read from them once
(``reference/verl_exports_reference.json``, made by ``reference/make_verl_exports_reference.py``
from the inputs of ``export_cases.py``); verl itself is not needed here."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors import safe_open
from safetensors.torch import load

from api.exports import PROMPTS_SCHEMA, prompt_row, verl_batch
from tests.api.export_cases import PAD, STARTS, samples

REFERENCE = json.loads((Path(__file__).parent / "reference"
                        / "verl_exports_reference.json").read_text())


def test_reference_is_from_verl_0_9_1() -> None:
    assert REFERENCE["verl_version"] == "0.9.1"


def test_prompt_rows_read_as_verl_read_them() -> None:
    rows = [prompt_row(s, index=i, group_id=s["group_id"], episode_id=s["episode_id"],
                       data_source="ref", ground_truth=s["ground_truth"])
            for i, s in enumerate(STARTS)]
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=PROMPTS_SCHEMA), sink)
    read = pq.read_table(io.BytesIO(sink.getvalue())).to_pylist()
    assert len(read) == len(REFERENCE["prompts"])
    for row, seen in zip(read, REFERENCE["prompts"], strict=True):
        assert row["prompt"] == seen["raw_prompt"]
        assert row["extra_info"]["index"] == seen["index"]
        assert row["data_source"] == seen["data_source"]
        assert row["reward_model"] == seen["reward_model"]
        assert row["extra_info"] == seen["extra_info"]


def test_batch_holds_what_verl_read_and_grpo_agrees(tmp_path: Path) -> None:
    from workers.trainer.egpo import grpo_advantages

    blob = verl_batch(samples(), pad_token_id=PAD, run_id="ref-run")
    tensors = load(blob)
    for name, expected in REFERENCE["batch"].items():
        got = tensors[name]
        want = torch.tensor(expected, dtype=got.dtype)
        assert got.shape == want.shape, name
        torch.testing.assert_close(got, want, atol=0, rtol=0, msg=name)
    path = tmp_path / "batch.safetensors"
    path.write_bytes(blob)
    with safe_open(str(path), framework="pt") as opened:
        uids_meta = json.loads(opened.metadata()["uids"])
    uids = [uids_meta[i] for i in tensors["uid"].tolist()]
    assert uids == REFERENCE["uid"]
    advantages, _ = grpo_advantages(tensors["token_level_scores"], tensors["response_mask"],
                                    np.array(uids, dtype=object))
    torch.testing.assert_close(advantages,
                               torch.tensor(REFERENCE["grpo_advantages"], dtype=torch.float32),
                               atol=1e-6, rtol=1e-6)
