"""Fixed inputs of the export reference (``reference/verl_exports_reference.json``): a few
``episode_started`` data for the prompt dataset and a few stored samples for the padded
batch, the same whenever they are built."""

from __future__ import annotations

from typing import Any

import numpy as np

from store.stored_sample import StoredSample
from tests.api.episodes import ADD_TOOL

PAD = 151643  # Qwen3's pad token

STARTS: list[dict[str, Any]] = [
    {"task_id": "arith-0-0", "group_id": "g0", "episode_id": "ep0", "ground_truth": "42",
     "messages": [{"role": "system", "content": "Use the tools."},
                  {"role": "user", "content": "What is 40 plus 2?"}], "tools": [ADD_TOOL]},
    {"task_id": "fc-1-3", "group_id": "g1", "episode_id": "ep3",
     "ground_truth": {"name": "add", "arguments": {"a": 1, "b": 2}},
     "messages": [{"role": "user", "content": [{"type": "text", "text": "Add 1 "},
                                               {"type": "text", "text": "and 2."}]}],
     "tools": [ADD_TOOL]},
    {"task_id": None, "group_id": "g2", "episode_id": "ep5", "ground_truth": None,
     "messages": [{"role": "user", "content": "Say hi."}], "tools": []},
]

# group, kind, reward, prompt length, response length, masked-out span of the response
_SAMPLES = [
    ("g0", "positive", 1.0, 7, 5, None),
    ("g0", "positive", 0.0, 4, 9, (3, 6)),
    ("g0", "negative", -1.0, 7, 3, None),
    ("g1", "positive", 0.5, 6, 6, (2, 4)),
    ("g1", "positive", 1.0, 5, 2, None),
    ("g2", "positive", None, 3, 4, None),
]


def samples() -> list[StoredSample]:
    rng = np.random.default_rng(7)
    out = []
    for i, (group, kind, reward, p, r, gap) in enumerate(_SAMPLES):
        ids = rng.integers(0, 150_000, p + r).astype(np.int32)
        mask = np.zeros(p + r, dtype=np.uint8)
        mask[p:] = 1
        if gap is not None:
            mask[p + gap[0]:p + gap[1]] = 0
        logprobs = np.where(mask == 1, -rng.uniform(0.01, 3.0, p + r), 0.0).astype(np.float32)
        out.append(StoredSample(
            sample_id=100 + i, run_id="ref-run", group_id=group, episode_id=f"ep{i}",
            agent="main", kind=kind, reward=reward, policy_version=0, prompt_length=p,
            token_ids=ids, loss_mask=mask, logprobs=logprobs))
    return out
