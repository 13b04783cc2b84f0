"""Checkpoints on shared storage named by fsspec URLs (``TrainerConfig.checkpoint_root``): a real
training step on the tiny model uploads its checkpoint under a ``file://`` URL (a real fsspec
filesystem) and ``policy_updated`` names the URL; a rollout engine (transformers backend) loads
that version from the URL through its download cache; a reopened trainer resumes from it; a URL
whose protocol fsspec does not know, or one that cannot be written, is refused before any
lease is taken, naming the URL and the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trainer_episodes
from safetensors.torch import load_file
from trainer_episodes import new_run, record_group

from store.eventlog import run_stream_id
from store.events import PolicyUpdated
from store.leasing import Leasing
from store.serving import policy_takeup
from workers import checkpoint_urls
from workers.engines.backend_transformers import TransformersBackend
from workers.rollout.group_log import StoreGroupLog
from workers.rollout.worker_engine import RolloutEngine
from workers.trainer.config import TrainerConfig
from workers.trainer.loop import Trainer

tiny_model = trainer_episodes.tiny_model
trainer_settings = trainer_episodes.trainer_settings
trainer_store = trainer_episodes.trainer_store


def _policy_updates(store, run_id: str) -> list[PolicyUpdated]:
    return [r.event for r in store.read_stream(run_stream_id(run_id))
            if isinstance(r.event, PolicyUpdated)]


def test_a_url_checkpoint_is_uploaded_loaded_by_an_engine_and_resumed_from(
        trainer_store, tiny_model: Path, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    root = f"file://{shared}/ckpts"
    run_id = new_run(trainer_store, tiny_model, group_size=2)
    player = TransformersBackend(tiny_model)
    for seed in (1, 2):
        record_group(trainer_store, player, run_id, size=2, seed=seed)
    config = TrainerConfig(lr=1e-3, groups_per_step=1, checkpoint_root=root)
    trainer = Trainer.open(trainer_store, run_id, config=config)

    first = trainer.step()
    assert first.version == 1
    url = first.checkpoint
    assert isinstance(url, str) and url.startswith(f"{root}/")
    assert [e.checkpoint for e in _policy_updates(trainer_store, run_id)] == [url]
    with pytest.raises(ValueError, match="checkpoint_root must be a non-empty string"):
        TrainerConfig(checkpoint_root=" ")
    # The files landed on the shared storage, marker included; no local copy is kept.
    landed = Path(url.removeprefix("file://"))
    assert (landed / "model.safetensors").is_file()
    assert (landed / checkpoint_urls.COMPLETE_MARKER).is_file()
    assert not list((trainer_store.settings.data_dir / "checkpoints").rglob("model.safetensors"))
    trained = {n: p.detach().clone() for n, p in trainer.model.state_dict().items()}
    saved = load_file(str(landed / "model.safetensors"))
    assert torch.equal(saved["model.norm.weight"], trained["model.norm.weight"])

    # A rollout engine elsewhere loads version 1 from the URL (downloaded into its cache).
    cache = tmp_path / "engine-cache"
    backend = TransformersBackend(tiny_model)
    engine = RolloutEngine(backend, kind="transformers", model_dir=tiny_model,
                           cache_dir=cache)
    log = StoreGroupLog(trainer_store)
    policy = log.policy(run_id)
    assert policy.version == 1 and policy.checkpoint == url
    engine.ensure(run_id, policy, report=log.policy_served)
    assert backend.policy_version == 1 and engine.loads == 1
    served = dict(backend.model.state_dict())
    for name in ("model.norm.weight", "model.embed_tokens.weight"):
        assert torch.equal(served[name].cpu(), trained[name].cpu()), name
    copies = [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert len(copies) == 1 and (copies[0] / "model.safetensors").is_file()
    took = {e.source for v in policy_takeup(trainer_store, run_id) if v.version == 1
            for e in v.engines}
    assert took == {url}

    # A reopened trainer resumes from the URL checkpoint: weights and step count.
    reopened = Trainer.open(trainer_store, run_id, config=config)
    assert reopened.steps_done == first.step
    for name, tensor in reopened.model.state_dict().items():
        assert torch.equal(tensor.cpu(), trained[name].cpu()), name
    assert reopened.optimizer.state, "the optimizer moments came back"
    second = reopened.step()
    assert second.version == 2 and isinstance(second.checkpoint, str)
    assert checkpoint_urls.is_complete(second.checkpoint)


def test_an_incomplete_upload_is_not_taken(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/half/v000001"
    (tmp_path / "half" / "v000001").mkdir(parents=True)
    (tmp_path / "half" / "v000001" / "model.safetensors").write_bytes(b"partial")
    assert not checkpoint_urls.is_complete(url)
    with pytest.raises(FileNotFoundError, match="missing or incomplete"):
        checkpoint_urls.download(url, tmp_path / "cache")


@pytest.mark.parametrize("kind", ["unknown protocol", "unwritable", "unwritable setting"])
def test_a_bad_checkpoint_url_is_refused_before_any_lease(
        trainer_store, tiny_model: Path, tmp_path: Path, kind: str) -> None:
    run_id = new_run(trainer_store, tiny_model, group_size=2)
    record_group(trainer_store, TransformersBackend(tiny_model), run_id, size=2, seed=1)
    if kind == "unknown protocol":
        root, reason = "nosuchfs://bucket/ckpts", "Protocol not known: nosuchfs"
    else:
        blocker = tmp_path / "a-file"
        blocker.write_text("not a folder")
        root, reason = f"file://{blocker}/ckpts", "cannot be written"
    settings = trainer_store.settings
    if kind == "unwritable setting":  # TRAJSTORE_CHECKPOINT_ROOT, no TrainerConfig field
        trainer_store.settings = settings.model_copy(update={"checkpoint_root": root})
        config = TrainerConfig(groups_per_step=1)
    else:
        config = TrainerConfig(groups_per_step=1, checkpoint_root=root)
    with pytest.raises(ValueError, match=reason) as refused:
        Trainer.open(trainer_store, run_id, config=config)
    assert root in str(refused.value)
    assert Leasing(trainer_store).stats(run_id)["leased"] == 0
    # Nothing was leased: a good trainer gets the group at once.
    trainer_store.settings = settings
    # (a plain folder as the root: checkpoints land under it, named by their path)
    folder = tmp_path / "plain-root"
    good = Trainer.open(trainer_store, run_id,
                        config=TrainerConfig(groups_per_step=1, checkpoint_root=str(folder)))
    result = good.step()
    assert result.version == 1 and result.samples == 2
    assert isinstance(result.checkpoint, Path) and result.checkpoint.is_dir()
    assert result.checkpoint.parent.parent == folder
    assert (result.checkpoint / "model.safetensors").is_file()
