"""Replay one recorded training step from the log and compare the weights it gives.

``replay_step(store, run, step)`` recomputes step ``step`` of a run:

- the step: the run's ``policy_updated`` that recorded ``step`` (its policy version, its
  checkpoint and, in the checkpoint's ``trainer_state.json``, the trainer configuration the
  step ran with, seed included);
- where it started: the checkpoint of the run's previous ``policy_updated`` (weights and
  optimizer moments), or the initial model with a fresh optimizer when the step is the
  run's first. The initial model (also the KL reference) is the one the trainer recorded in
  the step's checkpoint (``initial_model`` in ``trainer_state.json``: ``Trainer.open``'s
  ``model``, else the run's), else, for a checkpoint written before it was recorded, the
  run's ``RunConfig.model``; ``model=`` overrides both;
- what it trained: its lineage (``store.lineage``): the samples in batch order with the
  rewards they were trained with, read from the run's projection or from the dataset
  version the step named.

It then runs the same update the trainer runs (``Trainer.step`` with a distribution that
hands it that batch and records nothing) and compares every weight of the result with the
weights of the step's stored checkpoint. On the CPU in float32 with the same configuration
the update is deterministic, so a faithful log gives a largest absolute difference of 0.0.
Nothing is written: no event, no checkpoint, no lease.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from store import errors
from store.eventlog import EventStore, run_stream_id
from store.events import PolicyUpdated
from store.leasing import Lease, LeasedSample
from store.lineage import recorded_steps, sample_rows, step_lineage
from store.stored_sample import from_row
from workers import checkpoint_urls
from workers.engines.tokenizers import load_tokenizer
from workers.trainer.checkpoint import (
    load_model,
    load_optimizer_state,
    read_state,
)
from workers.trainer.config import TrainerConfig
from workers.trainer.dataset_source import rows_by_index
from workers.trainer.loop import OneProcess, StepHooks, Taken, Trainer

__all__ = ["ReplayResult", "replay_step"]


@dataclass(frozen=True)
class ReplayResult:
    """The outcome of a replay: the step and policy version replayed, where it started (a
    checkpoint folder, or the initial model), the stored checkpoint compared against, the
    number of samples, the largest absolute difference over every weight, the tensor it
    was found in, and the tensors only one side has (none when the replay is faithful).
    ``initial_model`` is the initial model the replay used (None when it needed none: a later
    step without a KL term) and ``initial_from`` where it came from: ``override`` (``model=``),
    ``recorded`` (the step's checkpoint) or ``run`` (``RunConfig.model``)."""

    run_id: str
    step: int
    policy_version: int
    started_from: str
    checkpoint: str
    samples: int
    dataset_id: int | None
    max_abs_diff: float
    worst_tensor: str | None
    tensors: int
    missing: list[str] = field(default_factory=list)
    initial_model: str | None = None
    initial_from: str | None = None

    def within(self, tolerance: float) -> bool:
        """True when every weight is within ``tolerance`` and no tensor is missing."""
        return not self.missing and self.max_abs_diff <= tolerance


class _Given(OneProcess):
    """Hands the step a prepared batch and records nothing."""

    def __init__(self, taken: Taken) -> None:
        self.taken = taken

    def take(self, trainer: Trainer, hooks: StepHooks) -> Taken:
        return self.taken

    def record(self, trainer: Trainer, taken: Taken, metrics: Callable[[], dict[str, float]],
               hooks: StepHooks) -> tuple[int, Path | str, dict[str, float]]:
        return 0, "", {}


class _Replayer(Trainer):
    def _keep_lease(self, lease: Lease, since: float) -> float:
        return since  # nothing is leased


def _folder(location: str | None, what: str, cache: Path) -> Path:
    if not location:
        raise errors.NotFoundError(f"{what} recorded no checkpoint")
    if checkpoint_urls.is_url(location):
        if not checkpoint_urls.is_complete(location):
            raise errors.NotFoundError(f"the checkpoint of {what} is missing: {location}")
        return checkpoint_urls.download(location, cache)
    path = Path(location)
    if not (path / "model.safetensors").is_file():
        raise errors.NotFoundError(f"the checkpoint of {what} is missing: {path}")
    return path


def _projection_samples(store: EventStore, ids: list[int], rewards: list[float]
                        ) -> list[LeasedSample]:
    rows = sample_rows(store.db, ids)
    out = []
    for sample_id, reward in zip(ids, rewards, strict=True):
        if sample_id not in rows:
            raise errors.NotFoundError(f"sample {sample_id} the step trained is no longer in "
                                       "the projection (rebuild it: trajstore replay --rebuild)")
        sample = from_row(rows[sample_id], as_type=LeasedSample, reward=float(reward),
                          status="leased")
        out.append(sample)
    return out


def _initial_model(run_config_model: str | None, state: dict[str, Any],
                   override: str | os.PathLike[str] | None) -> tuple[str | None, str | None]:
    """The initial model a replay uses and where it came from (see ``ReplayResult``)."""
    if override is not None:
        return str(override), "override"
    recorded = state.get("initial_model")
    if recorded:
        return str(recorded), "recorded"
    if run_config_model:
        return str(run_config_model), "run"
    return None, None


def _check_model(path: str, what: str) -> Path:
    folder = Path(path)
    if not folder.is_dir():
        raise errors.NotFoundError(f"{what} is missing: {path}")
    return folder


def replay_step(store: EventStore, run_id: str, step: int, *, version: int | None = None,
                device: str = "cpu", data_dir: Path | None = None,
                model: str | os.PathLike[str] | None = None) -> ReplayResult:
    """Recompute step ``step`` of ``run_id`` and compare it with its stored checkpoint
    (module docstring). ``version`` picks the policy version when two trainers recorded the
    same step. ``model`` is the initial model folder to use (the first step's starting
    weights and the KL reference) instead of the one the step's checkpoint recorded.
    Raises NotFoundError naming the run, the step, the missing checkpoint or sample, or the
    missing initial model folder (``model`` is checked even when the step does not need
    it), and ValueError for a step recorded under several versions without ``version``."""
    run = store.get_run(run_id)
    if model is not None:
        _check_model(str(model), "the initial model given (--model)")
    updates = sorted((r.event for r in store.read_stream(run_stream_id(run_id))
                      if isinstance(r.event, PolicyUpdated)), key=lambda e: e.version)
    matching = [e for e in updates if e.step == step
                and (version is None or e.version == version)]
    if not matching:
        raise errors.NotFoundError(
            f"run {run_id!r} recorded no step {step}"
            + (f" under policy version {version}" if version else "")
            + recorded_steps([e.step for e in updates if e.step is not None]))
    if len(matching) > 1:
        raise ValueError(f"step {step} of run {run_id!r} was recorded under policy versions "
                         f"{[e.version for e in matching]}: pass the version")
    target = matching[0]
    what = f"step {step} (policy version {target.version}) of run {run_id!r}"
    cache = (data_dir or store.settings.data_dir) / checkpoint_urls.CHECKPOINT_CACHE
    stored = _folder(target.checkpoint, what, cache)
    before = [e for e in updates if e.version < target.version]
    previous: Path | None = None
    if before:
        prev = before[-1]
        previous = _folder(prev.checkpoint, f"step {prev.step} (policy version {prev.version})"
                           f" of run {run_id!r}, the checkpoint {what} started from", cache)
    state = read_state(stored)
    values = dict(state.get("config") or {})
    if "betas" in values:
        values["betas"] = tuple(values["betas"])
    config = TrainerConfig(**values).replace(device=device)
    lineage = [v for v in step_lineage(store.db, run_id, step)
               if v.policy_version == target.version]
    if not lineage:
        raise errors.NotFoundError(f"{what} was recorded without the samples it trained")
    fed = lineage[0]
    ids = [s.sample_id for s in fed.samples]
    if fed.dataset_id is None:
        samples = _projection_samples(store, ids, [s.reward for s in fed.samples])
    else:
        samples = rows_by_index(store.db, fed.dataset_id, ids)
    initial, initial_from = _initial_model(run.config.model, state, model)
    needs_initial = previous is None or config.kl_coef > 0
    if needs_initial and initial is None:
        raise errors.NotFoundError(
            f"{what} " + ("is the run's first" if previous is None else "used a KL term")
            + ", its checkpoint records no initial model and the run names none "
            "(RunConfig.model): pass one (--model)")
    initial_path: Path | None = None
    if needs_initial:
        assert initial is not None
        label = {"override": "the initial model given (--model)",
                 "recorded": f"the initial model {what} recorded",
                 "run": "the run's initial model (RunConfig.model)"}[str(initial_from)]
        initial_path = _check_model(initial, label)
    torch.manual_seed(config.seed)
    torch_device = torch.device(device)
    start = previous if previous is not None else initial_path
    assert start is not None
    policy = load_model(start, device=torch_device, dtype=config.dtype)
    reference = None
    if config.kl_coef > 0:
        assert initial_path is not None
        reference = load_model(initial_path, device=torch_device, dtype=config.dtype)
        reference.requires_grad_(False)
    tokenizer = load_tokenizer(run.config.tokenizer_name or initial or str(start))
    lease = Lease(lease_id=uuid.uuid4(), run_id=run_id,
                  groups=list(dict.fromkeys(s.group_id for s in samples)),
                  expires_at=dt.datetime.now(dt.UTC), samples=samples,
                  dataset_id=fed.dataset_id)
    replayer = _Replayer(store=store, run_id=run_id, run_config=run.config, model=policy,
                         tokenizer=tokenizer, config=config,
                         data_dir=data_dir or store.settings.data_dir, device=torch_device,
                         reference=reference,
                         step=int(read_state(previous).get("step", 0)) if previous else 0)
    if previous is not None:
        load_optimizer_state(previous, replayer.optimizer)
        for group in replayer.optimizer.param_groups:
            group.update(lr=config.lr, betas=config.betas, eps=config.adam_eps,
                         weight_decay=config.weight_decay)
    batch, scoring = replayer._pad(lease)
    replayer.distribution = _Given(Taken(lease, batch, scoring, 0, 0, "replay"))
    replayer.step()
    result = _compare(replayer.model, stored, run_id=run_id, step=step, target=target,
                      started_from=str(start), samples=len(samples),
                      dataset_id=fed.dataset_id)
    return dataclasses.replace(result, initial_model=initial if needs_initial else None,
                               initial_from=initial_from if needs_initial else None)


def _compare(model: Any, stored: Path, *, run_id: str, step: int, target: PolicyUpdated,
             started_from: str, samples: int, dataset_id: int | None) -> ReplayResult:
    saved = load_file(str(stored / "model.safetensors"))
    mine = {name: t.detach().cpu() for name, t in model.state_dict().items()}
    worst, largest = None, 0.0
    for name, tensor in saved.items():
        if name not in mine:
            continue
        diff = float((mine[name].to(torch.float64) - tensor.to(torch.float64)).abs().max())
        if diff > largest or worst is None:
            worst, largest = name, max(largest, diff)
    missing = sorted(set(saved) - set(mine))
    return ReplayResult(run_id=run_id, step=step, policy_version=target.version,
                        started_from=started_from, checkpoint=str(stored), samples=samples,
                        dataset_id=dataset_id, max_abs_diff=largest,
                        worst_tensor=worst if largest > 0 else None,
                        tensors=len(saved) - len(missing), missing=missing)
