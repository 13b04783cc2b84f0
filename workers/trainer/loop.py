"""The training step, top to bottom.

One :meth:`Trainer.step`:

1. lease complete groups of the run (``store.leasing``), stale ones skipped;
2. pad the samples into ``(bs, seq)`` / ``(bs, response_length)`` tensors, each with the
   temperature it is scored at: the one it was sampled at (``workers.trainer.temperature``);
3. the old log-probs and entropies (a no-grad forward, or the update's own first forward
   where that is exact: ``workers.trainer.update``), and the reference model's log-probs when
   a KL term is configured; from them and the rollout log-probs, the run's off-policy
   correction (``workers.trainer.correction``: IS weights, rejection mask);
4. place each sample's reward on its last response token;
5. advantages: EGPO or GRPO, as the run's configuration says, over episodes when
   ``RunConfig.rollout_level`` (each episode counted once and weighted equally in the loss);
6. PPO mini-batch epochs with gradient accumulation, one optimizer step per mini-batch
   (``workers.trainer.update.update_batch`` does 3 to 6);
7. save a checkpoint (safetensors) under the data directory, or under
   ``TrainerConfig.checkpoint_root`` (a folder, or an fsspec URL the checkpoint is uploaded
   to: :mod:`workers.checkpoint_urls`);
8. append ``policy_updated`` (version, step, metrics, checkpoint, and the samples it trained:
   their ids, episodes and rewards, ``store.lineage``) to the run's stream;
9. push the weights to the rollout engine, when one is attached, and record that it serves
   the new version (``policy_served``, ``store.serving``); the step's metrics tell how the
   engines took the version it started from (:func:`takeup_metrics`);
10. acknowledge the lease.

A failure before the acknowledgement releases the lease, so the samples go back to ready; a
failure after the first optimizer step also marks the trainer unusable (its weights are ahead
of its last checkpoint): open a new one, which resumes from the newest checkpoint.

There is one step. How it is spread over processes is its distribution strategy
(:class:`Distribution`): :class:`OneProcess` leases, trains, records and acknowledges alone;
``workers.trainer.distributed.Ranks`` leases on rank 0 and hands every rank the batch, gives
each rank its rows of every mini-batch, sums the ranks' statistics, and gathers the
checkpoint on rank 0. Steps 3 to 6 are the same code either way.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import socket
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from store.datasets import DatasetVersion
from store.eventlog import EventStore, run_stream_id
from store.events import PolicyUpdated, RunConfig, TrainedSamples
from store.leasing import Lease, LeaseExpired, Leasing
from store.queries import episode_sampling_params
from store.serving import (
    append_policy_updated,
    call_policy_versions,
    policy_takeup,
    record_policy_served,
)
from workers import checkpoint_urls
from workers.engines.backend import WeightUpdatable
from workers.engines.identity import engine_id
from workers.engines.tokenizers import load_tokenizer
from workers.trainer.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageSettings,
    batch_advantages,
    choose_estimator,
    think_token_ids,
)
from workers.trainer.batch import TrainingBatch, pad_samples, token_level_rewards
from workers.trainer.checkpoint import (
    checkpoint_dir,
    load_model,
    load_optimizer_state,
    prune_checkpoints,
    read_state,
    save_checkpoint,
)
from workers.trainer.config import TrainerConfig
from workers.trainer.correction import Correction
from workers.trainer.dataset_source import dataset_lease, dataset_samples, resolve_dataset
from workers.trainer.optim import adamw
from workers.trainer.ppo import PPOStats, Sharding
from workers.trainer.temperature import scoring_temperatures
from workers.trainer.update import update_batch
from workers.trainer.weights import push_weights

__all__ = ["Distribution", "OneProcess", "StepHooks", "StepResult", "Taken", "Trainer",
           "TrainerBroken", "call_staleness_metrics", "default_device", "staleness_metrics",
           "takeup_metrics",
           "trained_samples", "unit_ids", "unit_loss_weights"]


log = logging.getLogger(__name__)


class TrainerBroken(RuntimeError):
    """A step failed after changing the weights; this trainer must be reopened."""


@dataclass(frozen=True)
class StepHooks:
    """Optional callbacks at three points of a step (monitoring and fault-injection tests):
    ``after_lease(lease)`` once samples are leased (where the lease is held),
    ``after_batch(rank)`` in every process once it holds the batch, ``before_ack(lease)``
    right before the acknowledgement."""

    after_lease: Callable[[Lease], None] | None = None
    after_batch: Callable[[int], None] | None = None
    before_ack: Callable[[Lease], None] | None = None


@dataclass(frozen=True)
class Taken:
    """What a step trains: the lease (in the process that holds it, else None), the padded
    batch on the CPU (None: nothing ready), the scoring-temperature metrics, the stale groups
    skipped, the policy version the step started from, and the tag of its checkpoint."""

    lease: Lease | None
    batch: TrainingBatch | None
    scoring: dict[str, float] = field(default_factory=dict)
    skipped_stale: int = 0
    current: int = 0
    tag: str = ""


class Distribution(Protocol):
    """How :meth:`Trainer.step` is spread over processes (module docstring)."""

    @property
    def sharding(self) -> Sharding | None:
        """This process's share of each mini-batch (None: all of it)."""
        ...

    @property
    def rank(self) -> int:
        """This process's rank (0 alone)."""
        ...

    def take(self, trainer: Trainer, hooks: StepHooks) -> Taken:
        """Lease and pad the step's batch where the lease is taken, and hand it to every
        process; an error there is raised in every process (the lease released)."""
        ...

    def score(self, trainer: Trainer
              ) -> tuple[Callable[[Any, TrainingBatch], tuple[torch.Tensor, torch.Tensor]]
                         | None, Any, Any]:
        """``(score, scored, reference)`` for :func:`~workers.trainer.update.update_batch`:
        how whole-batch log-probs are computed, of what policy and what reference."""
        ...

    def reduce(self, stats: PPOStats, device: torch.device) -> None:
        """Make ``stats`` the whole batch's (summed over processes)."""
        ...

    def record(self, trainer: Trainer, taken: Taken, metrics: Callable[[], dict[str, float]],
               hooks: StepHooks) -> tuple[int, Path | str, dict[str, float]]:
        """Save the checkpoint, append ``policy_updated``, acknowledge the lease; returns
        the version, the checkpoint and the metrics, the same in every process."""
        ...


class OneProcess:
    """The trainer alone in its process: it leases, trains, records, pushes its weights to
    the attached engine and acknowledges."""

    sharding: Sharding | None = None
    rank = 0

    def take(self, trainer: Trainer, hooks: StepHooks) -> Taken:
        return trainer.lease_and_pad(hooks)

    def score(self, trainer: Trainer
              ) -> tuple[Callable[[Any, TrainingBatch], tuple[torch.Tensor, torch.Tensor]]
                         | None, Any, Any]:
        return None, None, trainer.reference

    def reduce(self, stats: PPOStats, device: torch.device) -> None:
        return None

    def record(self, trainer: Trainer, taken: Taken, metrics: Callable[[], dict[str, float]],
               hooks: StepHooks) -> tuple[int, Path | str, dict[str, float]]:
        lease = taken.lease
        assert lease is not None
        values = metrics()
        version, path = trainer._record(values, lease)
        trainer.weights_ahead = False  # recorded: a reopened trainer resumes from here
        try:
            if trainer.engine is not None:
                trainer._push(version)
        finally:
            if hooks.before_ack is not None:
                hooks.before_ack(lease)
            if lease.dataset_id is None:
                trainer.leasing.ack(lease.lease_id, policy_version=version)
        return version, path, values


@dataclass(frozen=True)
class StepResult:
    """What one step did. ``version`` is None when nothing was trained (no complete group
    ready, or only stale ones, counted in ``skipped_stale``)."""

    run_id: str
    version: int | None
    step: int
    samples: int = 0
    groups: int = 0
    skipped_stale: int = 0
    sample_ids: tuple[int, ...] = ()
    metrics: dict[str, float] = field(default_factory=dict)
    #: The checkpoint's folder, or its URL when the checkpoint root is one.
    checkpoint: Path | str | None = None

    @property
    def trained(self) -> bool:
        return self.version is not None


def trained_samples(lease: Lease) -> TrainedSamples:
    """What the step trained from ``lease`` (its ``policy_updated``'s ``trained``): the
    leased samples' ids, episodes and rewards, in batch order, and the dataset version they
    are rows of (None: the run's own projection; the ids are then row indexes)."""
    return TrainedSamples(sample_ids=[s.sample_id for s in lease.samples],
                          episode_ids=[s.episode_id for s in lease.samples],
                          rewards=[s.reward for s in lease.samples],
                          dataset_id=lease.dataset_id)


def staleness_metrics(policy_versions: tuple[int | None, ...], current: int
                      ) -> dict[str, float]:
    """Version gap of the trained samples: ``current - policy_version`` as
    ``version_gap_min``/``_mean``/``_max`` over the samples that know their version (none of
    these keys when no sample does), and ``version_unknown`` counting the others."""
    gaps = [current - v for v in policy_versions if v is not None]
    out = {"version_unknown": float(len(policy_versions) - len(gaps))}
    if gaps:
        out.update(version_gap_min=float(min(gaps)), version_gap_mean=sum(gaps) / len(gaps),
                   version_gap_max=float(max(gaps)))
    return out


def call_staleness_metrics(call_versions: Mapping[str, Sequence[int]], current: int
                           ) -> dict[str, float]:
    """Version gap counted over LLM calls, not episodes (``call_versions``: each trained
    episode's calls' policy versions, :func:`store.serving.call_policy_versions`): ``calls``,
    ``calls_stale`` (calls made on an older version than ``current``),
    ``call_version_gap_min``/``_mean``/``_max`` (none of these keys without calls) and
    ``episodes_mixed_versions`` (episodes whose calls span several versions: played across
    a policy update, ``rollout.continue_across_updates``)."""
    gaps = [current - v for versions in call_versions.values() for v in versions]
    out = {"calls": float(len(gaps)), "calls_stale": float(sum(1 for g in gaps if g > 0)),
           "episodes_mixed_versions": float(sum(1 for versions in call_versions.values()
                                                if len(set(versions)) > 1))}
    if gaps:
        out.update(call_version_gap_min=float(min(gaps)),
                   call_version_gap_mean=sum(gaps) / len(gaps),
                   call_version_gap_max=float(max(gaps)))
    return out


def unit_ids(*, episode_ids: Sequence[str], sample_ids: Sequence[int],
             is_negative: Sequence[bool]) -> tuple[str, ...]:
    """The rollout-level unit of each sample: its episode, except that every negative sample
    is a unit of its own (seed 000: a failed attempt keeps its own weight in its group)."""
    return tuple(f"negative:{int(sid)}" if bool(neg) else str(episode)
                 for episode, sid, neg in zip(episode_ids, sample_ids, is_negative,
                                              strict=True))


def unit_loss_weights(units: Sequence[str]) -> torch.Tensor:
    """``(bs,)`` float32: ``1 / (samples of the unit)`` per sample, so every unit (episode)
    weighs the same in the loss whatever number of samples it yielded."""
    counts = Counter(units)
    return torch.tensor([1.0 / counts[u] for u in units], dtype=torch.float32)


def takeup_metrics(store: EventStore, run_id: str, version: int) -> dict[str, float]:
    """How rollout engines took ``version`` of the run (``store.serving``): ``takeup_engines``
    (how many reported it) and, when they have lags, ``takeup_lag_max_s`` and
    ``takeup_lag_mean_s`` (from its ``policy_updated`` to each report). A step records these
    for the version it started from, so every version's take-up lands in the next step's
    metrics."""
    found = policy_takeup(store, run_id, version=version)
    if not found:
        return {"takeup_engines": 0.0}
    out = {"takeup_engines": float(len(found[0].engines))}
    if found[0].lag_max_seconds is not None:
        out["takeup_lag_max_s"] = float(found[0].lag_max_seconds)
        out["takeup_lag_mean_s"] = float(found[0].lag_mean_seconds or 0.0)
    return out


def default_device() -> str:
    """"cuda" when a GPU is visible to torch, "cpu" otherwise."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _latest_checkpoint(store: EventStore, run_id: str, *,
                       cache_dir: Path | None = None) -> Path | None:
    """The checkpoint folder of the run's newest ``policy_updated`` that still exists. A
    checkpoint named by a URL counts when its upload is complete; it is downloaded into
    ``cache_dir`` (:func:`workers.checkpoint_urls.download`) and the local copy returned
    (without ``cache_dir``, URL checkpoints are passed over)."""
    newest: tuple[int, str] | None = None
    for recorded in store.read_stream(run_stream_id(run_id)):
        event = recorded.event
        if not isinstance(event, PolicyUpdated) or not event.checkpoint:
            continue
        if newest is not None and event.version < newest[0]:
            continue
        location = event.checkpoint
        if checkpoint_urls.is_url(location):
            if cache_dir is not None and checkpoint_urls.is_complete(location):
                newest = (event.version, location)
        elif Path(location).is_dir():
            newest = (event.version, location)
    if newest is None:
        return None
    if checkpoint_urls.is_url(newest[1]):
        assert cache_dir is not None
        return checkpoint_urls.download(newest[1], cache_dir)
    return Path(newest[1])


class Trainer:
    """Trains one run's policy from leased samples. Build it with :meth:`open`."""

    def __init__(self, *, store: EventStore, run_id: str, run_config: RunConfig, model: Any,
                 tokenizer: Any, config: TrainerConfig, data_dir: Path, device: torch.device,
                 engine: WeightUpdatable | None = None, reference: Any | None = None,
                 step: int = 0, name: str | None = None,
                 distribution: Distribution | None = None,
                 dataset: DatasetVersion | None = None,
                 initial_model: str | None = None) -> None:
        self.store, self.run_id, self.run_config = store, run_id, run_config
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.data_dir, self.device, self.engine = data_dir, device, engine
        self.reference, self.steps_done = reference, step
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.leasing = Leasing(store)
        self.optimizer = adamw(model.parameters(), lr=config.lr, betas=config.betas,
                               eps=config.adam_eps, weight_decay=config.weight_decay)
        self.estimator = choose_estimator(config.advantage_estimator,
                                          egpo_lam=run_config.egpo.lam)
        start, end = think_token_ids(tokenizer, start=config.cot_start_id, end=config.cot_end_id)
        if self.estimator == "egpo" and (start is None or end is None):
            raise ValueError("EGPO needs <think>/</think> token ids: the tokenizer lacks them; "
                             "set TrainerConfig.cot_start_id and cot_end_id")
        self.advantage_settings = AdvantageSettings(
            norm_adv_by_std=config.norm_adv_by_std, lam=run_config.egpo.lam,
            alpha=run_config.egpo.alpha, variant=run_config.egpo.variant,
            cot_start_id=start, cot_end_id=end,
            negatives_in_baseline=run_config.negatives.baseline == "group")
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (
            tokenizer.eos_token_id)
        self.pad_token_id = int(pad) if pad is not None else 0
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.correction = run_config.correction
        if config.temperature is not None:
            log.warning("run %s: every sample is scored at TrainerConfig.temperature=%s, not "
                        "at the temperature it was sampled with (the run's rollout "
                        "temperature is %s)", run_id, config.temperature,
                        run_config.rollout.temperature)
        self.broken = False
        #: The weights changed since the last checkpoint (set by an optimizer step).
        self.weights_ahead = False
        self.distribution: Distribution = distribution or OneProcess()
        #: The dataset version the steps train (None: the run's own projection;
        #: ``workers.trainer.dataset_source``).
        self.dataset: DatasetVersion | None = dataset
        #: The initial model this trainer started from (``Trainer.open``'s ``model``, else the
        #: run's ``RunConfig.model``): the first step's starting weights and the KL
        #: reference. Each checkpoint records it as ``initial_model`` for ``replay-step``.
        self.initial_model = initial_model

    @classmethod
    def open(cls, store: EventStore, run_id: str, *, config: TrainerConfig | None = None,
             data_dir: str | os.PathLike[str] | None = None, model: str | None = None,
             engine: WeightUpdatable | None = None, name: str | None = None,
             dataset: str | int | None = None) -> Trainer:
        """A trainer for ``run_id``, resumed from the run's newest checkpoint (weights,
        optimizer moments and step count) or, before the first update, loaded from ``model``
        (default: the run's ``RunConfig.model``). The tokenizer is the run's
        (``RunConfig.tokenizer``, else the model's). Checkpoints go under ``data_dir``
        (default: the store's settings). ``engine`` receives the weights after each update,
        and the resumed weights at once. ``dataset`` (``"NAME@VERSION"``, ``"NAME"`` or a
        dataset id of the run's project) makes every step train that version's rows instead
        of the run's own projection (``workers.trainer.dataset_source``).

        Checkpoints go under ``config.checkpoint_root``, else the settings'
        ``checkpoint_root``, else ``<data_dir>/checkpoints``; a URL root is checked at once by
        writing and deleting a probe file there
        (:func:`workers.checkpoint_urls.check_writable`); checkpoints named by URLs are
        downloaded to ``<data_dir>/checkpoint-cache`` to resume from.

        Raises ``store.errors.NotFoundError`` for an unknown run, ValueError when neither
        ``model`` nor the run names a model folder or when the checkpoint URL's protocol is
        unknown or it cannot be written (naming the URL and the reason), and the loaders'
        errors.
        """
        config = config or TrainerConfig()
        if config.checkpoint_root is None and store.settings.checkpoint_root:
            config = config.replace(checkpoint_root=store.settings.checkpoint_root)
        if checkpoint_urls.is_url(config.checkpoint_root):
            checkpoint_urls.check_writable(str(config.checkpoint_root))
        run = store.get_run(run_id)
        source = (resolve_dataset(store.db, run.project, dataset) if dataset is not None
                  else None)
        initial = model or run.config.model
        if initial is None:
            raise ValueError(f"run {run_id!r} names no model (RunConfig.model); pass model=")
        device = torch.device(config.device or default_device())
        torch.manual_seed(config.seed)
        folder = Path(data_dir) if data_dir else store.settings.data_dir
        resume = _latest_checkpoint(store, run_id,
                                    cache_dir=folder / checkpoint_urls.CHECKPOINT_CACHE)
        policy = load_model(resume or initial, device=device, dtype=config.dtype)
        reference = None
        if config.kl_coef > 0:
            reference = load_model(initial, device=device, dtype=config.dtype)
            reference.requires_grad_(False)
        tokenizer = load_tokenizer(run.config.tokenizer_name or initial)
        trainer = cls(store=store, run_id=run_id, run_config=run.config, model=policy,
                      tokenizer=tokenizer, config=config,
                      data_dir=folder, device=device, engine=engine, reference=reference,
                      step=int(read_state(resume).get("step", 0)) if resume else 0, name=name,
                      dataset=source, initial_model=str(Path(initial).absolute()))
        if resume is not None:
            load_optimizer_state(resume, trainer.optimizer)
            for group in trainer.optimizer.param_groups:  # the configured settings win
                group.update(lr=config.lr, betas=config.betas, eps=config.adam_eps,
                             weight_decay=config.weight_decay)
            if engine is not None:  # the engine may hold older weights than the checkpoint
                trainer._push(int(read_state(resume)["version"]))
        return trainer

    def step(self, *, hooks: StepHooks | None = None) -> StepResult:
        """Lease, train, record, push, acknowledge (module docstring), spread over processes
        as :attr:`distribution` says (every process calls it). Returns what happened, the
        same in every process; raises TrainerBroken when an earlier step left this trainer
        unusable, and, when any process failed, the error in every one (the lease
        released)."""
        if self.broken:
            raise TrainerBroken("a previous step failed after changing the weights; reopen "
                                "the trainer to resume from its newest checkpoint")
        hooks = hooks or StepHooks()
        started = time.monotonic()
        config = self.config
        spread = self.distribution
        taken = spread.take(self, hooks)
        if taken.batch is None:
            return StepResult(self.run_id, None, self.steps_done,
                              skipped_stale=taken.skipped_stale)
        lease = taken.lease
        self.weights_ahead = False
        try:
            batch = taken.batch.to(self.device)
            if hooks.after_batch is not None:
                hooks.after_batch(spread.rank)
            units = (unit_ids(episode_ids=batch.episode_ids, sample_ids=batch.sample_ids,
                              is_negative=batch.is_negative.tolist())
                     if self.run_config.rollout_level else None)
            renewed = [started]

            def keep_lease() -> None:
                if lease is not None:
                    renewed[0] = self._keep_lease(lease, renewed[0])

            def stepping(*_: Any) -> None:
                self.weights_ahead = True  # from the first optimizer step on

            score, scored, reference = spread.score(self)
            hook = self.optimizer.register_step_pre_hook(stepping)
            try:
                update = update_batch(
                    self.model, batch, optimizer=self.optimizer, config=config,
                    estimator=self.estimator, advantage_settings=self.advantage_settings,
                    correction=self.correction, reference=reference, units=units,
                    unit_weights=unit_loss_weights(units) if units is not None else None,
                    between_steps=keep_lease, sharding=spread.sharding, score=score,
                    scored=scored)
            finally:
                hook.remove()
            stats = update.stats
            spread.reduce(stats, self.device)
            self.steps_done += stats.optimizer_steps

            def metrics() -> dict[str, float]:
                assert lease is not None  # built where the lease is held
                values = self._metrics(batch, lease, update.old_log_probs, update.entropies,
                                       update.advantages, stats.metrics(), started,
                                       update.correction, taken.current)
                values["scoring_skipped"] = float(update.single_pass)
                values.update(taken.scoring)
                if self.estimator == "egpo":
                    values.update(self._egpo_bonus(batch, update.advantages,
                                                   update.entropies, units))
                values.update(takeup_metrics(self.store, self.run_id, taken.current))
                return values

            version, path, recorded = spread.record(self, taken, metrics, hooks)
        except BaseException:
            if self.weights_ahead:
                self.broken = True
            if lease is not None and lease.dataset_id is None:
                try:
                    self.leasing.release(lease.lease_id)
                except LeaseExpired:
                    pass  # acknowledged or expired already: nothing to give back
            raise
        return StepResult(self.run_id, version, self.steps_done, samples=len(batch),
                          groups=len(lease.groups) if lease else len(set(batch.group_ids)),
                          skipped_stale=taken.skipped_stale, sample_ids=batch.sample_ids,
                          metrics=recorded, checkpoint=path)

    def lease_and_pad(self, hooks: StepHooks) -> Taken:
        """Lease the step's groups (stale ones skipped) and pad them into a batch; a failure
        once leased releases the lease."""
        config = self.config
        current = self.leasing.current_policy_version(self.run_id)
        if self.dataset is not None:
            samples = dataset_samples(self.store.db, self.dataset, self.run_id,
                                      groups=config.groups_per_step)
            if not samples:
                return Taken(None, None)
            rows = dataset_lease(self.run_id, samples, self.dataset.dataset_id)
            if hooks.after_lease is not None:
                hooks.after_lease(rows)
            batch, scoring = self._pad(rows)
            return Taken(rows, batch, scoring, 0, current, rows.lease_id.hex[:8])
        lease = self.leasing.lease_batch(
            self.run_id, groups=config.groups_per_step, lease_seconds=config.lease_seconds,
            max_staleness=config.max_staleness, current_version=current, trainer=self.name)
        if lease is None or not lease.samples:
            return Taken(None, None, skipped_stale=lease.skipped_stale if lease else 0)
        try:
            if hooks.after_lease is not None:
                hooks.after_lease(lease)
            batch, scoring = self._pad(lease)
        except BaseException:
            try:
                self.leasing.release(lease.lease_id)
            except LeaseExpired:
                pass
            raise
        return Taken(lease, batch, scoring, lease.skipped_stale, current,
                     lease.lease_id.hex[:8])

    def train(self, steps: int, *, wait_s: float = 0.0, poll_s: float = 1.0,
              on_step: Callable[[StepResult], None] | None = None) -> list[StepResult]:
        """Run up to ``steps`` training steps; when no batch is ready, poll every ``poll_s``
        seconds for up to ``wait_s`` seconds, then stop early. ``on_step`` sees each trained
        step. Returns the trained steps. Raises ValueError for ``steps < 1`` or negative
        waits."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be a positive integer, got {steps!r}")
        if wait_s < 0 or poll_s <= 0:
            raise ValueError(f"wait_s must be >= 0 and poll_s > 0, got {wait_s!r}, {poll_s!r}")
        done: list[StepResult] = []
        while len(done) < steps:
            deadline = time.monotonic() + wait_s
            while not (result := self.step()).trained and time.monotonic() < deadline:
                time.sleep(poll_s)
            if not result.trained:
                break
            done.append(result)
            if on_step is not None:
                on_step(result)
        return done

    def _pad(self, lease: Lease) -> tuple[TrainingBatch, dict[str, float]]:
        """The leased samples padded into a batch (on the CPU), each row with the temperature
        it is scored at (``workers.trainer.temperature``: the override, else what its episode
        recorded, else the run's rollout temperature), and the scoring-temperature metrics."""
        episode_ids = [s.episode_id for s in lease.samples]
        recorded = ({} if self.config.temperature is not None
                    else episode_sampling_params(self.store, episode_ids))
        temperatures, metrics = scoring_temperatures(
            episode_ids, recorded, self.run_config, override=self.config.temperature)
        batch = pad_samples(lease.samples, pad_token_id=self.pad_token_id,
                            vocab_size=self.vocab_size, temperatures=temperatures)
        return batch, metrics

    def _checkpoint_target(self, version: int, tag: str) -> tuple[Path, str | None]:
        """Where the checkpoint of ``version`` is saved: the local folder and, when the
        checkpoint root is a URL, the URL it is uploaded to (the local folder is then a
        staging copy under the data directory)."""
        local = checkpoint_dir(self.data_dir, self.run_id, version=version, tag=tag)
        root = self.config.checkpoint_root
        if root is None:
            return local, None
        relative = local.relative_to(self.data_dir / "checkpoints")
        if checkpoint_urls.is_url(root):
            return local, checkpoint_urls.join(root, *relative.parts)
        return Path(root).expanduser() / relative, None

    def _record(self, metrics: dict[str, float], lease: Lease) -> tuple[int, Path | str]:
        """Save the checkpoint and append ``policy_updated`` under the next free version.

        The run stream's version is checked on append, so two trainers of one run can never
        record the same policy version: the loser of a race saves again under the next one
        (engines' ``policy_served`` reports in the same stream are waited out, not lost to:
        ``store.serving.append_policy_updated``).
        Each checkpoint folder carries the lease id, so racing trainers never write into the
        same folder. With a URL checkpoint root the checkpoint is saved locally, uploaded
        (marker last) and the local copy deleted before ``policy_updated`` names the URL."""
        while True:
            version = self.leasing.current_policy_version(self.run_id) + 1
            local, url = self._checkpoint_target(version, lease.lease_id.hex[:8])
            path = save_checkpoint(
                local, model=self.model, tokenizer=self.tokenizer, optimizer=self.optimizer,
                state=self._state(version, metrics))
            if url is not None:
                try:
                    checkpoint_urls.upload(path, url)
                finally:
                    shutil.rmtree(path, ignore_errors=True)
            if append_policy_updated(self.store, self.run_id, PolicyUpdated(
                    version=version, step=self.steps_done, metrics=metrics,
                    checkpoint=url or str(path), trained=trained_samples(lease))) is None:
                if url is not None:
                    checkpoint_urls.remove(url)
                else:
                    shutil.rmtree(path, ignore_errors=True)
                continue
            if url is not None:
                checkpoint_urls.prune(url.rsplit("/", 1)[0], keep=self.config.keep_checkpoints)
                return version, url
            prune_checkpoints(path.parent, keep=self.config.keep_checkpoints)
            return version, path

    def _state(self, version: int, metrics: dict[str, float]) -> dict[str, Any]:
        """The trainer state a checkpoint of ``version`` records (``trainer_state.json``):
        run, version, step, metrics, the trainer configuration and the initial model."""
        return {"run_id": self.run_id, "version": version, "step": self.steps_done,
                "metrics": metrics, "config": self.config.to_dict(),
                "initial_model": self.initial_model}

    def _push(self, version: int) -> None:
        """Push the weights into the attached engine and record that it serves ``version``
        (``policy_served``, source ``push``)."""
        assert self.engine is not None
        started = time.monotonic()
        push_weights(self.model, self.engine, version=version)
        record_policy_served(self.store, self.run_id, version=version,
                             engine=engine_id(self.engine), backend=type(self.engine).__name__,
                             source="push", load_seconds=time.monotonic() - started)

    def _keep_lease(self, lease: Lease, since: float) -> float:
        """Renew the lease when half of it has passed since ``since`` (a ``time.monotonic()``
        reading: the lease or its last renewal); returns the new reading."""
        if lease.dataset_id is not None:
            return since  # a dataset's rows are not leased
        now = time.monotonic()
        if now - since <= self.config.lease_seconds / 2:
            return since
        self.leasing.renew(lease.lease_id, self.config.lease_seconds)
        return now

    def _egpo_bonus(self, batch: TrainingBatch, advantages: torch.Tensor,
                    entropies: torch.Tensor, units: Any) -> dict[str, float]:
        """EGPO's entropy bonus in this step: each response's advantage minus its plain GRPO
        advantage. ``egpo_bonus_mean`` is the mean size of the bonus over the responses that
        got one, ``egpo_bonus_frac`` their share (a response with a zero advantage or no
        ``<think>`` tokens gets none)."""
        rewards = token_level_rewards(batch.rewards, batch.response_mask,
                                      response_lengths=batch.response_lengths)
        plain = batch_advantages(
            ADVANTAGE_ESTIMATORS.get("grpo"), rewards, batch.response_mask, batch.group_ids,
            batch.is_negative, entropies=entropies, responses=batch.responses,
            settings=self.advantage_settings, units=units)
        mask = batch.response_mask
        rows = mask.sum(dim=1).clamp(min=1)
        bonus = ((advantages - plain).abs() * mask).sum(dim=1) / rows
        got = bonus > 0
        return {"egpo_bonus_mean": float(bonus[got].mean().item()) if bool(got.any()) else 0.0,
                "egpo_bonus_frac": float(got.float().mean().item()) if len(bonus) else 0.0}

    def _metrics(self, batch: TrainingBatch, lease: Lease, old_log_probs: torch.Tensor,
                 entropies: torch.Tensor, advantages: torch.Tensor, ppo: dict[str, float],
                 started: float, correction: Correction, current: int) -> dict[str, float]:
        mask = batch.response_mask
        tokens = mask.sum().clamp(min=1)
        positive = ~batch.is_negative
        rewards = batch.rewards[positive] if bool(positive.any()) else batch.rewards
        rows = mask.sum(dim=1) > 0
        metrics = {
            "samples": float(len(batch)),
            "groups": float(len(lease.groups)),
            "negatives": float(batch.is_negative.sum().item()),
            "episodes": float(len(set(batch.episode_ids))),
            "skipped_stale": float(lease.skipped_stale),
            "trainable_tokens": float(mask.sum().item()),
            "reward_mean": float(rewards.mean().item()),
            "reward_min": float(rewards.min().item()),
            "reward_max": float(rewards.max().item()),
            "advantage_mean": float(((advantages * mask).sum(dim=1)[rows]
                                     / mask.sum(dim=1)[rows]).mean().item())
            if bool(rows.any()) else 0.0,
            "old_entropy": float(((entropies * mask).sum() / tokens).item()),
            # Mismatch between the engine's sampling log-probs and the trainer's recomputation.
            "rollout_logprob_abs_diff": float(
                ((old_log_probs - batch.rollout_log_probs).abs() * mask).sum().item()
                / tokens.item()),
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "step_seconds": time.monotonic() - started,
            **correction.metrics,
            **staleness_metrics(batch.policy_versions, current),
            **call_staleness_metrics(call_policy_versions(self.store, batch.episode_ids),
                                     current),
            **ppo,
        }
        return {name: value for name, value in metrics.items() if math.isfinite(value)}
