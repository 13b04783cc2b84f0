"""Generate ``verl_exports_reference.json`` beside this file: what verl itself reads from the
``verl-prompts`` and ``verl-batch`` exports of the fixed inputs in ``tests/api/export_cases.py``.

``test_exports_reference.py`` compares today's exports with it, so a change to a column, a
padding rule or a mask that verl would read differently fails without verl installed.
Produced with **verl 0.9.1** (``RLHFDataset``, ``DataProto``,
``core_algos.compute_grpo_outcome_advantage``), torch on CPU and Qwen3's tokenizer.

To regenerate (keep verl out of the project's own environment)::

    pip install --target /tmp/verl --no-deps verl==0.9.1 omegaconf \
        antlr4-python3-runtime==4.9.3 ray tensordict datasets codetiming dill pylatexenc \
        multiprocess xxhash pyvers msgpack pandas
    PYTHONPATH=$PWD:/tmp/verl python tests/api/reference/make_verl_exports_reference.py
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import verl
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import load
from verl import DataProto
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
from verl.utils.dataset.rl_dataset import RLHFDataset

from api.exports import PROMPTS_SCHEMA, prompt_row, verl_batch
from tests.api.export_cases import PAD, STARTS, samples
from workers.engines.tokenizers import load_tokenizer

OUTPUT = Path(__file__).with_name("verl_exports_reference.json")
TENSORS = ("input_ids", "attention_mask", "position_ids", "prompts", "responses",
           "response_mask", "rollout_log_probs", "token_level_scores")


def main() -> None:
    rows = [prompt_row(s, index=i, group_id=s["group_id"], episode_id=s["episode_id"],
                       data_source="ref", ground_truth=s["ground_truth"])
            for i, s in enumerate(STARTS)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prompts.parquet"
        pq.write_table(pa.Table.from_pylist(rows, schema=PROMPTS_SCHEMA), path)
        dataset = RLHFDataset(str(path), load_tokenizer("qwen3"), OmegaConf.create({
            "max_prompt_length": 1024, "filter_overlong_prompts_workers": 1,
            "cache_dir": str(Path(tmp) / "cache")}))
        prompts = [{k: dataset[i][k] for k in ("raw_prompt", "index", "data_source",
                                               "reward_model", "extra_info", "tools_kwargs")}
                   for i in range(len(dataset))]
    blob = verl_batch(samples(), pad_token_id=PAD, run_id="ref-run")
    tensors = load(blob)
    with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        f.write(blob)
        f.flush()
        with safe_open(f.name, framework="pt") as opened:
            uids = json.loads(opened.metadata()["uids"])
    batch = DataProto.from_dict(
        tensors={k: tensors[k] for k in TENSORS},
        non_tensors={"uid": np.array([uids[i] for i in tensors["uid"].tolist()],
                                     dtype=object)})
    advantages, _ = compute_grpo_outcome_advantage(
        token_level_rewards=batch.batch["token_level_scores"],
        response_mask=batch.batch["response_mask"], index=batch.non_tensor_batch["uid"])
    OUTPUT.write_text(json.dumps({
        "verl_version": verl.__version__,
        "prompts": prompts,
        "batch": {k: batch.batch[k].tolist() for k in TENSORS},
        "uid": batch.non_tensor_batch["uid"].tolist(),
        "grpo_advantages": advantages.tolist(),
    }, indent=1, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)) + "\n")
    print(f"wrote {OUTPUT}")


if __name__ == "__main__":
    main()
