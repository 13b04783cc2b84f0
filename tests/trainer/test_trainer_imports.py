"""The trainer's math modules import with torch alone: no numpy, database or transformers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
sys.modules["numpy"] = None  # "import numpy" now fails, as if numpy were not installed
import torch
import workers.trainer.egpo as egpo
import workers.trainer.losses as losses
import workers.trainer.logits as logits
advantages, _ = egpo.egpo_advantages(
    torch.tensor([[1.0, 0.0], [0.0, 0.0]]), torch.ones(2, 2), ["a", "a"],
    torch.full((2, 2), 0.5), torch.tensor([[7, 5], [7, 5]]), cot_start_id=7, cot_end_id=8,
    norm_adv_by_std=False, variant="paper",
)
loss, _ = losses.ppo_policy_loss(torch.zeros(2, 2), torch.zeros(2, 2), advantages, torch.ones(2, 2))
targets = torch.zeros(1, 2, dtype=torch.long)
lp, h = logits.logprobs_and_entropy_from_logits(torch.zeros(1, 2, 4), targets)
heavy = [m for m in ("psycopg", "sqlalchemy", "celery", "transformers", "store")
         if m in sys.modules]
print(advantages[:, 0].tolist(), heavy)
"""


def test_imports_with_torch_only() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    # A = +-0.5, paper bonus min(0.4 * 0.5, 0.25) = 0.2; nothing heavy was imported.
    assert done.stdout.strip().splitlines()[-1] == "[0.699999988079071, -0.30000001192092896] []"
