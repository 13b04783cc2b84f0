"""The trainer across processes (FSDP2 on gloo, real ``torchrun`` subprocesses): the same step
on one process and on two gives the same loss and weights; a rank SIGKILLed mid-step trains
nothing twice; setups a batch cannot feed are refused before any lease."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import trainer_episodes
from safetensors.torch import load_file
from trainer_episodes import new_run, record_group

from store import migrate
from store.db import Database
from store.eventlog import EventStore, run_stream_id
from store.events import PolicyUpdated
from store.leasing import Leasing
from store.settings import Settings
from workers.engines.backend_transformers import TransformersBackend
from workers.trainer.checkpoint import load_model
from workers.trainer.config import TrainerConfig
from workers.trainer.distributed import balanced_split, check_setup, checkpoint_activations
from workers.trainer.loop import Trainer
from workers.trainer.policy import response_log_probs

tiny_model = trainer_episodes.tiny_model
trainer_settings = trainer_episodes.trainer_settings
trainer_store = trainer_episodes.trainer_store

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("trainer_distributed_worker.py")
# adam_eps above the default: Adam's first step moves every weight by about lr * g / |g|,
# so on weights whose gradient is ~1e-8 (as small as eps) the last bits of a sum taken in
# another order (packed micro-batches, two ranks) move the update by ~1e-5; a larger eps
# keeps the comparison about the sharding, not about Adam's sign on vanishing gradients.
CONFIG = {"lr": 1e-3, "groups_per_step": 2, "micro_batch_size": 3, "adam_eps": 1e-6}


def torchrun(settings: Settings, run_id: str, *, nproc: int, config: dict[str, Any] = CONFIG,
             **extra: Any) -> subprocess.Popen[str]:
    args = {"url": settings.database_url, "data_dir": str(settings.data_dir),
            "run_id": run_id, "config": config, **extra}
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(WORKER.parent)])
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={nproc}", "--monitor-interval=0.5", str(WORKER), json.dumps(args)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)


def two_runs(store: Any, model: Path, correction: dict[str, Any] | None = None
             ) -> tuple[str, str]:
    """Two runs holding the same samples (same episodes, same seeds)."""
    runs = (new_run(store, model, group_size=4, correction=correction),
            new_run(store, model, group_size=4, correction=correction))
    engine = TransformersBackend(model)
    for run_id in runs:
        for seed in (1, 2):
            record_group(store, engine, run_id, size=4, seed=seed)
    return runs


def test_activation_checkpointing_keeps_gradients_and_saves_less(tiny_model: Path) -> None:
    from torch.autograd.graph import saved_tensors_hooks

    from workers.trainer.batch import pad_samples

    class Sample:
        def __init__(self, index: int, length: int) -> None:
            rng = np.random.default_rng(index)
            self.sample_id, self.group_id, self.kind = index, "g", "positive"
            self.reward, self.policy_version, self.prompt_length = 1.0, 0, 3
            self.token_ids = rng.integers(0, 700, length)
            self.loss_mask = (np.arange(length) >= 3).astype(np.int64)
            self.logprobs = np.zeros(length, dtype=np.float32)

    batch = pad_samples([Sample(i, 20 + 7 * i) for i in range(3)], pad_token_id=0)
    results = []
    for wrap in (False, True):
        model = load_model(tiny_model)
        if wrap:
            assert checkpoint_activations(model) == 2
            assert checkpoint_activations(model) == 0  # already wrapped
        saved = [0]

        def pack(tensor: torch.Tensor, saved: list[int] = saved) -> torch.Tensor:
            saved[0] += tensor.numel()
            return tensor

        with saved_tensors_hooks(pack, lambda tensor: tensor):
            log_probs, _ = response_log_probs(model, batch)
        (log_probs * batch.response_mask).sum().backward()
        results.append((saved[0], {n: p.grad for n, p in model.named_parameters()}))
    (plain_saved, plain), (wrapped_saved, wrapped) = results
    assert wrapped_saved < plain_saved  # the layers' activations were not kept
    for name, grad in plain.items():
        assert torch.allclose(wrapped[name], grad, atol=1e-6), name


def test_balanced_split_balances_tokens() -> None:
    assert balanced_split([10, 1, 1, 8], 2) == [[0], [1, 2, 3]]
    shares = balanced_split([5, 5, 5], 4)
    assert sorted(map(len, shares)) == [0, 1, 1, 1]
    assert sorted(i for share in balanced_split(list(range(1, 12)), 3) for i in share) == list(
        range(11))
    with pytest.raises(ValueError, match="world_size"):
        balanced_split([1], 0)


#: Bypass mode: the rollout log-probs are the old policy, IS weights and rejection are
#: computed in each micro-batch's loss (workers.trainer.correction.bypass_policy_loss).
BYPASS = {"mode": "bypass", "loss_type": "reinforce", "is_level": "token", "is_threshold": 1.5,
          "rejection": [{"mode": "seq_mean_k1", "upper": 1.5}]}


#: The setups two processes must train exactly like one: (pack, checkpointing, correction).
VARIANTS: dict[str, tuple[bool, bool, dict[str, Any] | None]] = {
    "padded": (False, False, None), "packed": (True, False, None),
    "checkpointed": (False, True, None), "bypass": (False, False, BYPASS)}


@pytest.fixture(scope="module")
def variants(pg_server: Any, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[tuple[EventStore, dict[str, tuple[str, str]], dict[str, Any]]]:
    """Every setup of VARIANTS trained on two processes by one ``torchrun`` (one start of the
    ranks for all four; each setup has a trainer and a run of its own): the store, each
    setup's (one-process run, two-process run), and rank 0's result line per run."""
    url = pg_server.create_database()
    migrate.upgrade(url)
    settings = Settings(database_url=url, data_dir=tmp_path_factory.mktemp("variants") / "data")
    store = EventStore(Database(url, max_size=4), settings)
    runs = {name: two_runs(store, tiny_model, correction)
            for name, (_, _, correction) in VARIANTS.items()}
    jobs = [{"run_id": runs[name][1], "pack": pack, "checkpointing": checkpointing}
            for name, (pack, checkpointing, _) in VARIANTS.items()]
    proc = torchrun(settings, "", nproc=2, jobs=jobs)
    out, err = proc.communicate(timeout=500)
    assert proc.returncode == 0, f"{err[-3000:]}\nstdout: {out[-1000:]}"
    results = {line["run_id"]: line for line in
               (json.loads(text) for text in out.splitlines() if text.startswith('{"run_id"'))}
    yield store, runs, results
    store.close()
    pg_server.drop_database(url)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_two_processes_train_like_one(variants, tiny_model: Path, variant: str) -> None:
    store, runs, results = variants
    single_run, dist_run = runs[variant]
    single = Trainer.open(store, single_run, config=TrainerConfig(**CONFIG))
    expected = single.step()  # one process, right-padded micro-batches
    assert expected.trained and expected.samples == 8

    result = results[dist_run]
    assert result["version"] == 1 and len(result["samples"]) == 8

    # Same loss and metrics, same updated weights.
    for name in ("pg_loss", "ppo_kl", "entropy", "old_entropy", "trainable_tokens"):
        assert result["metrics"][name] == pytest.approx(expected.metrics[name], abs=1e-5), name
    assert result["metrics"]["world_size"] == 2.0
    ours = load_file(str(Path(result["checkpoint"]) / "model.safetensors"))
    theirs = single.model.state_dict()
    assert set(ours) == set(theirs)
    worst = max(float((ours[k] - theirs[k]).abs().max()) for k in ours)
    assert worst < 1e-5, worst
    # The weights moved at all (the comparison is not between two untouched models).
    initial = load_file(str(tiny_model / "model.safetensors"))
    assert max(float((ours[k] - initial[k]).abs().max()) for k in initial) > 1e-4

    # Rank 0 recorded and acknowledged: the samples are consumed, the event names the folder.
    leasing = Leasing(store)
    assert leasing.stats(dist_run)["consumed"] == 8
    events = [r.event for r in store.read_stream(run_stream_id(dist_run))]
    updated = [e for e in events if isinstance(e, PolicyUpdated)]
    assert [e.version for e in updated] == [1] and updated[0].checkpoint == result["checkpoint"]


def test_resumed_two_processes_train_like_one(trainer_store, trainer_settings,
                                              tiny_model: Path, tmp_path: Path) -> None:
    """Each step in a new process group: the second resumes the weights and the sharded
    optimizer moments (torch.distributed.checkpoint) of the first; also with checkpoints
    uploaded under a ``file://`` URL (resumed from the download cache). Both roots train in
    the same process groups (one ``torchrun`` per step, a job per root)."""
    base: dict[str, Any] = {**CONFIG, "groups_per_step": 1}
    configs = {"data dir": base, "url": {**base, "checkpoint_root": f"file://{tmp_path}/shared"}}
    runs = {root: two_runs(trainer_store, tiny_model) for root in configs}
    expected = {}
    for root, config in configs.items():
        for _ in range(2):  # reopened each time: resumes from its own checkpoint
            expected[root] = Trainer.open(trainer_store, runs[root][0],
                                          config=TrainerConfig(**config)).step()
        assert expected[root].version == 2
    results: dict[str, dict[str, Any]] = {}
    for version in (1, 2):
        proc = torchrun(trainer_settings, "", nproc=2,
                        jobs=[{"run_id": runs[root][1], "config": config}
                              for root, config in configs.items()])
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{err[-3000:]}\nstdout: {out[-1000:]}"
        lines = {line["run_id"]: line for line in
                 (json.loads(text) for text in out.splitlines() if text.startswith('{"run_id"'))}
        for root in configs:
            results[root] = lines[runs[root][1]]
            assert results[root]["version"] == version, root
    for root, result in results.items():
        folder = Path(str(result["checkpoint"]).removeprefix("file://"))
        assert str(result["checkpoint"]).startswith("file://") == (root == "url")
        assert (folder / "optimizer-dcp").is_dir(), root
        ours = load_file(str(folder / "model.safetensors"))
        theirs = load_file(str(expected[root].checkpoint).removeprefix("file://")
                           + "/model.safetensors")
        assert max(float((ours[k] - theirs[k]).abs().max()) for k in ours) < 1e-5, root
        assert result["metrics"]["pg_loss"] == pytest.approx(expected[root].metrics["pg_loss"],
                                                             abs=1e-5), root


def test_killed_rank_trains_nothing_twice(trainer_store, trainer_settings, tiny_model: Path,
                                          tmp_path: Path) -> None:
    run_id = new_run(trainer_store, tiny_model, group_size=4)
    engine = TransformersBackend(tiny_model)
    for seed in (1, 2):
        record_group(trainer_store, engine, run_id, size=4, seed=seed)
    hold_file = tmp_path / "held.pid"
    proc = torchrun(trainer_settings, run_id, nproc=2, hold_rank=1, hold_file=str(hold_file))
    deadline = time.monotonic() + 240
    while not hold_file.exists() or not hold_file.read_text():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "rank 1 never held the batch"
        time.sleep(0.2)
    leasing = Leasing(trainer_store)
    assert leasing.stats(run_id)["leased"] == 8  # rank 0 leased the step's batch
    os.kill(int(hold_file.read_text()), signal.SIGKILL)
    proc.communicate(timeout=240)
    assert proc.returncode != 0

    # Nothing was acknowledged or recorded; the samples come back (released by rank 0, or
    # once the lease expires).
    events = [r.event for r in trainer_store.read_stream(run_stream_id(run_id))]
    assert not [e for e in events if isinstance(e, PolicyUpdated)]
    stats = leasing.stats(run_id)
    assert stats["consumed"] == 0
    if stats["ready"] != 8:
        from datetime import UTC, datetime, timedelta

        leasing.expire(now=datetime.now(UTC) + timedelta(seconds=3600))
    assert leasing.stats(run_id)["ready"] == 8

    # A trainer that comes after trains each sample exactly once.
    trainer = Trainer.open(trainer_store, run_id, config=TrainerConfig(**CONFIG))
    result = trainer.step()
    assert result.version == 1 and sorted(result.sample_ids) == sorted(set(result.sample_ids))
    assert len(result.sample_ids) == 8 and leasing.stats(run_id)["consumed"] == 8
    assert not trainer.step().trained


def test_setups_that_cannot_train_are_refused(trainer_store, tiny_model: Path,
                                              tmp_path: Path) -> None:
    run_id = new_run(trainer_store, tiny_model, group_size=2)
    run_config = trainer_store.get_run(run_id).config
    config = TrainerConfig(groups_per_step=2)
    check_setup(run_config, config, world_size=4, model=tiny_model, data_dir=tmp_path,
                run_id=run_id)
    with pytest.raises(ValueError, match="world size 5 cannot be fed.*4 samples"):
        check_setup(run_config, config, world_size=5, model=tiny_model, data_dir=tmp_path,
                    run_id=run_id)
    with pytest.raises(ValueError, match="mini-batch has 2"):
        check_setup(run_config, config.replace(mini_batch_size=2), world_size=3,
                    model=tiny_model, data_dir=tmp_path, run_id=run_id)
    not_lm = tmp_path / "vit"
    not_lm.mkdir()
    (not_lm / "config.json").write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(ValueError, match="not a causal LM"):
        check_setup(run_config, config, world_size=2, model=not_lm, data_dir=tmp_path,
                    run_id=run_id)
    with pytest.raises(ValueError, match="no config.json"):
        check_setup(run_config, config, world_size=2, model=tmp_path, data_dir=tmp_path,
                    run_id=run_id)
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    with pytest.raises(ValueError, match="cannot be written"):
        check_setup(run_config, config, world_size=2, model=tiny_model, data_dir=blocked,
                    run_id=run_id)
    with pytest.raises(ValueError, match="'nosuchfs://x'.*Protocol not known"):
        check_setup(run_config, config.replace(checkpoint_root="nosuchfs://x"), world_size=2,
                    model=tiny_model, data_dir=tmp_path, run_id=run_id)
    with pytest.raises(ValueError, match=f"'file://{blocked}/c' cannot be written"):
        check_setup(run_config, config.replace(checkpoint_root=f"file://{blocked}/c"),
                    world_size=2, model=tiny_model, data_dir=tmp_path, run_id=run_id)
    # Nothing was leased.
    assert Leasing(trainer_store).stats(run_id)["leased"] == 0


def run_cli(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
    env.update({"TRAJSTORE_DATABASE_URL": settings.database_url or "",
                "TRAJSTORE_DATA_DIR": str(settings.data_dir), "COLUMNS": "200",
                "OMP_NUM_THREADS": "1"})
    return subprocess.run([sys.executable, "-m", "trajstore", "train", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300, check=False)


def test_train_command_starts_ranks_with_torchrun(trainer_store, trainer_settings: Settings,
                                                  tiny_model: Path) -> None:
    run_id = new_run(trainer_store, tiny_model, group_size=2, max_negatives=0)
    engine = TransformersBackend(tiny_model)
    for seed in (1, 2):
        record_group(trainer_store, engine, run_id, size=2, seed=seed, max_tokens=4)
    leasing = Leasing(trainer_store)

    refused = run_cli(trainer_settings, "--run", run_id, "--groups", "1", "--nproc", "3")
    assert refused.returncode == 1 and "world size 3 cannot be fed" in refused.stdout
    assert leasing.stats(run_id)["ready"] == 4  # refused before any lease

    done = run_cli(trainer_settings, "--run", run_id, "--steps", "3", "--groups", "1",
                   "--lr", "1e-3", "--nproc", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [step["version"] for step in steps] == [1, 2]
    assert leasing.current_policy_version(run_id) == 2
    assert leasing.stats(run_id)["consumed"] == 4
