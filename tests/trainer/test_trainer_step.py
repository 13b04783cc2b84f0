"""One training step end to end on the tiny model: real episodes recorded into PostgreSQL and
projected, leased, trained; the checkpoint, the ``policy_updated`` event, the consumed samples
and the rollout engine's new output."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
import trainer_episodes
from trainer_episodes import new_run, record_group

from store.eventlog import run_stream_id
from store.events import PolicyUpdated
from store.leasing import Leasing
from workers.engines.backend import GenerationRequest, SamplingParams
from workers.engines.backend_transformers import TransformersBackend
from workers.trainer.checkpoint import load_model, read_state
from workers.trainer.config import TrainerConfig
from workers.trainer.loop import StepHooks, Trainer, TrainerBroken

tiny_model = trainer_episodes.tiny_model
trainer_settings = trainer_episodes.trainer_settings
trainer_store = trainer_episodes.trainer_store

PROMPT = GenerationRequest(sampling=SamplingParams(temperature=0.0, max_tokens=12),
                           messages=({"role": "user", "content": "Write digits only."},))


def test_one_step_changes_weights_records_and_pushes(trainer_store, tiny_model: Path) -> None:
    run_id = new_run(trainer_store, tiny_model, group_size=4)
    engine = TransformersBackend(tiny_model)
    for seed in (1, 2):
        record_group(trainer_store, engine, run_id, size=4, seed=seed)
    before_engine = engine.generate(PROMPT)
    config = TrainerConfig(lr=1e-2, groups_per_step=2, micro_batch_size=3)
    trainer = Trainer.open(trainer_store, run_id, config=config, engine=engine)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}

    result = trainer.step()

    assert result.trained and result.version == 1 and result.step == 1
    assert result.samples == 8 and result.groups == 2
    changed = [k for k, v in trainer.model.state_dict().items() if not torch.equal(v, before[k])]
    assert "lm_head.weight" in changed and len(changed) > 10
    # The recomputed old log-probs agree with what the engine sampled (same weights).
    assert result.metrics["rollout_logprob_abs_diff"] < 1e-4
    for name in ("pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "grad_norm", "reward_mean"):
        assert name in result.metrics
    assert "egpo_bonus_mean" not in result.metrics  # a GRPO run has no entropy bonus

    # The event, the checkpoint and the samples.
    events = [r.event for r in trainer_store.read_stream(run_stream_id(run_id))]
    updated = [e for e in events if isinstance(e, PolicyUpdated)]
    assert len(updated) == 1 and updated[0].version == 1 and updated[0].step == 1
    assert updated[0].checkpoint == str(result.checkpoint)
    assert read_state(result.checkpoint)["version"] == 1
    saved = load_model(result.checkpoint).state_dict()
    assert all(torch.equal(saved[k], v) for k, v in trainer.model.state_dict().items())
    assert Leasing(trainer_store).stats(run_id)["consumed"] == 8
    assert Leasing(trainer_store).current_policy_version(run_id) == 1

    # The engine runs the new weights: same prompt, greedy, a different answer.
    after_engine = engine.generate(PROMPT)
    assert engine.policy_version == 1 and after_engine.policy_version == 1
    assert (not np.array_equal(before_engine.response_ids, after_engine.response_ids)
            or not np.allclose(before_engine.logprobs, after_engine.logprobs, atol=1e-4))
    engine_state = engine.model.state_dict()
    assert all(torch.equal(engine_state[k], v) for k, v in trainer.model.state_dict().items())

    # Nothing left: the next step trains nothing.
    assert not trainer.step().trained


def test_reopened_trainer_resumes_from_checkpoint(trainer_store, tiny_model: Path) -> None:
    run_id = new_run(trainer_store, tiny_model, group_size=2)
    engine = TransformersBackend(tiny_model)
    for seed in (1, 2):
        record_group(trainer_store, engine, run_id, size=2, seed=seed)
    config = TrainerConfig(lr=1e-3, groups_per_step=1)
    first = Trainer.open(trainer_store, run_id, config=config)
    assert first.step().version == 1
    fresh_engine = TransformersBackend(tiny_model)
    second = Trainer.open(trainer_store, run_id, config=config, engine=fresh_engine)
    assert second.steps_done == 1
    assert fresh_engine.policy_version == 1  # the resumed weights were pushed at once
    assert torch.equal(fresh_engine.model.lm_head.weight, first.model.lm_head.weight)
    assert all(torch.equal(second.model.state_dict()[k], v)
               for k, v in first.model.state_dict().items())
    moments = [s["exp_avg"] for s in second.optimizer.state.values()]
    assert moments and any(bool(m.abs().sum() > 0) for m in moments)
    assert second.step().version == 2


def test_failure_before_update_releases_lease(trainer_store, tiny_model: Path) -> None:
    run_id = new_run(trainer_store, tiny_model, group_size=2)
    engine = TransformersBackend(tiny_model)
    record_group(trainer_store, engine, run_id, size=2, seed=3)
    trainer = Trainer.open(trainer_store, run_id, config=TrainerConfig(lr=1e-3))

    def fail(_lease: object) -> None:
        raise OSError("disk full")

    # A failure before the weights change gives the samples back and keeps the trainer.
    with pytest.raises(OSError, match="disk full"):
        trainer.step(hooks=StepHooks(after_lease=fail))
    assert Leasing(trainer_store).stats(run_id)["ready"] == 2
    assert trainer.step().version == 1


def test_failure_after_update_releases_lease_and_breaks_trainer(
        trainer_store, tiny_model: Path, tmp_path: Path) -> None:
    run_id = new_run(trainer_store, tiny_model, group_size=2)
    engine = TransformersBackend(tiny_model)
    record_group(trainer_store, engine, run_id, size=2, seed=4)
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the checkpoints folder should be")
    trainer = Trainer.open(trainer_store, run_id, config=TrainerConfig(lr=1e-3),
                           data_dir=blocked)
    with pytest.raises(OSError):
        trainer.step()  # the optimizer stepped, then the checkpoint could not be written
    assert Leasing(trainer_store).stats(run_id)["ready"] == 2
    assert Leasing(trainer_store).current_policy_version(run_id) == 0
    with pytest.raises(TrainerBroken, match="reopen"):
        trainer.step()
    reopened = Trainer.open(trainer_store, run_id, config=TrainerConfig(lr=1e-3),
                            data_dir=tmp_path / "data")
    assert reopened.step().version == 1


def test_open_refuses_run_without_model(trainer_store, tiny_model: Path) -> None:
    from store.errors import NotFoundError
    from store.eventlog import NO_STREAM
    from store.events import RunConfig, RunCreated

    trainer_store.append(run_stream_id("bare"), [RunCreated(run_id="bare", config=RunConfig())],
                         NO_STREAM)
    with pytest.raises(ValueError, match="names no model"):
        Trainer.open(trainer_store, "bare")
    with pytest.raises(NotFoundError):
        Trainer.open(trainer_store, "no-such-run")


def test_long_steps_renew_their_lease(trainer_store, tiny_model: Path) -> None:
    run_id = new_run(trainer_store, tiny_model, group_size=2)
    record_group(trainer_store, TransformersBackend(tiny_model), run_id, size=2, seed=5)
    trainer = Trainer.open(trainer_store, run_id,
                           config=TrainerConfig(lr=1e-3, lease_seconds=60.0))
    leasing = Leasing(trainer_store)
    lease = leasing.lease_batch(run_id, groups=1, lease_seconds=1.0)
    assert lease is not None
    now = time.monotonic()
    assert trainer._keep_lease(lease, now) == now  # within the first half: no renewal
    renewed_at = trainer._keep_lease(lease, now - 31.0)  # past half of 60 s: renewed
    assert renewed_at > now - 31.0
    with trainer_store.db.connection() as conn:
        expires_at = conn.execute("SELECT expires_at FROM leases WHERE lease_id = %s",
                                  (lease.lease_id,)).fetchone()[0]
    assert (expires_at - lease.expires_at).total_seconds() > 30  # 1 s became about 60 s
    leasing.release(lease.lease_id)


def test_failure_before_the_first_optimizer_step_keeps_the_trainer(
        trainer_store, tiny_model: Path) -> None:
    run_id = new_run(trainer_store, tiny_model, group_size=2)
    engine = TransformersBackend(tiny_model)
    record_group(trainer_store, engine, run_id, size=2, seed=5)
    trainer = Trainer.open(trainer_store, run_id, config=TrainerConfig(lr=1e-3))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    failures = ["the optimizer could not step"]

    def fail_once(*_: object) -> None:
        if failures:
            raise RuntimeError(failures.pop())

    # Scored, advantages computed, gradients taken; the optimizer fails before changing a
    # weight: the samples go back and the trainer stays usable.
    trainer.optimizer.register_step_pre_hook(fail_once)
    with pytest.raises(RuntimeError, match="could not step"):
        trainer.step()
    assert all(torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())
    assert Leasing(trainer_store).stats(run_id)["ready"] == 2
    assert trainer.step().version == 1


def test_egpo_step_reports_its_entropy_bonus(trainer_store, tiny_model: Path) -> None:
    """An EGPO step records the share of responses whose advantage got the entropy bonus and
    the bonus's mean size over them; responses with a <think> block and a nonzero advantage
    get one."""
    from workers.engines.backend_replay import ReplayBackend

    run_id = new_run(trainer_store, tiny_model, group_size=4, lam=0.1)
    engine = TransformersBackend(tiny_model)
    think = "<think>\nsome thought here\n</think>\n\n"
    for seed in (1, 2):
        # Digits-task rewards differ inside each group, so advantages are nonzero.
        script = ReplayBackend(engine, [think + "77", think + "a7", "77", think + "ab"])
        record_group(trainer_store, script, run_id, size=4, seed=seed, max_tokens=32)
    trainer = Trainer.open(trainer_store, run_id,
                           config=TrainerConfig(lr=1e-2, groups_per_step=2))
    metrics = trainer.step().metrics
    assert 0.0 < metrics["egpo_bonus_frac"] <= 1.0 and metrics["egpo_bonus_mean"] > 0
