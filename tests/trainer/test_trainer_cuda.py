"""The training step on a CUDA device (skipped without one): the trainer picks CUDA by
default, trains there, and pushes to an engine on the same device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trainer_episodes
from trainer_episodes import new_run, record_group

from workers.engines.backend_transformers import TransformersBackend
from workers.trainer.config import TrainerConfig
from workers.trainer.loop import Trainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

tiny_model = trainer_episodes.tiny_model
trainer_settings = trainer_episodes.trainer_settings
trainer_store = trainer_episodes.trainer_store


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_step_on_cuda(trainer_store, tiny_model: Path, dtype: str) -> None:
    run_id = new_run(trainer_store, tiny_model, group_size=4)
    engine = TransformersBackend(tiny_model, device="cuda")
    record_group(trainer_store, engine, run_id, size=4, seed=1)
    trainer = Trainer.open(trainer_store, run_id, engine=engine,
                           config=TrainerConfig(lr=1e-2, dtype=dtype))
    assert trainer.device.type == "cuda"
    assert next(trainer.model.parameters()).device.type == "cuda"
    before = trainer.model.lm_head.weight.detach().float().clone()
    result = trainer.step()
    assert result.trained and result.samples == 4
    assert not torch.equal(trainer.model.lm_head.weight.detach().float(), before)
    if dtype == "float32":
        assert result.metrics["rollout_logprob_abs_diff"] < 1e-3
    assert torch.equal(engine.model.lm_head.weight.float(),
                       trainer.model.lm_head.weight.detach().float())
