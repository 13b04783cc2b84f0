"""The training step across several processes: FSDP2 (``fully_shard``) launched by ``torchrun``.

One step, with ``N`` ranks (every rank runs :meth:`DistributedTrainer.step`):

1. rank 0 leases complete groups (one lease per step, as :class:`~workers.trainer.loop.Trainer`)
   and broadcasts the padded batch to every rank;
2. every rank scores its share of the rows without gradients; the old log-probs and entropies
   are summed across ranks (each row is scored by exactly one rank), and every rank computes
   the same advantages from the same whole-batch tensors;
3. :func:`~workers.trainer.ppo.ppo_update` runs on every rank with a :class:`RankSharding`:
   each mini-batch's rows are split across ranks by tokens (:func:`balanced_split`), each
   rank's loss is normalised by the whole mini-batch's token (or sequence) count times ``N``,
   and FSDP averages the gradients, so the update equals the single-process one; ranks with
   fewer micro-batches run zero-weighted ones so that their collectives pair up;
4. the full state dict is gathered on rank 0, which saves the consolidated checkpoint
   (safetensors, loadable by any engine) with the sharded optimizer state that every rank
   wrote with ``torch.distributed.checkpoint`` (:data:`OPTIMIZER_DIR`), uploads both when
   the checkpoint root is an fsspec URL (:mod:`workers.checkpoint_urls`), appends
   ``policy_updated`` naming its folder or URL, and acknowledges the lease.

Only rank 0 talks to the store. A rank that dies fails the step on the others before the
acknowledgement (its collectives break, or ``torchrun`` stops the group): rank 0 releases the
lease when it can, and otherwise the lease expires, so the samples go back to ready and
nothing is trained twice.

Launch with ``trajstore train --run R --nproc N`` or
``torchrun --standalone --nproc-per-node N -m workers.trainer.distributed '{"run": "R"}'``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import signal
import sys
import time
import types
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, cast

import torch
import torch.distributed as dist

from store.eventlog import EventStore
from store.events import PolicyUpdated, RunConfig
from store.leasing import Lease
from store.serving import append_policy_updated
from workers import checkpoint_urls
from workers.engines.transformers_lock import LOCK
from workers.trainer.batch import TrainingBatch
from workers.trainer.checkpoint import (
    checkpoint_dir,
    load_model,
    prune_checkpoints,
    read_state,
    save_checkpoint,
)
from workers.trainer.config import TrainerConfig
from workers.trainer.loop import StepHooks, Taken, Trainer, _latest_checkpoint, trained_samples
from workers.trainer.packing import packed_response_log_probs
from workers.trainer.policy import response_log_probs
from workers.trainer.ppo import PPOStats, micro_batches

__all__ = [
    "OPTIMIZER_DIR",
    "DistributedHooks",
    "DistributedTrainer",
    "RankSharding",
    "Ranks",
    "balanced_split",
    "check_setup",
    "checkpoint_activations",
    "exit_rank",
    "main",
    "shard_model",
]


#: The checkpoint's sub-folder with the sharded optimizer state (torch.distributed.checkpoint).
OPTIMIZER_DIR = "optimizer-dcp"


def balanced_split(tokens: Sequence[int], world_size: int) -> list[list[int]]:
    """Indices into ``tokens`` for each of ``world_size`` ranks, balancing the token sums:
    longest first, each to the rank with the fewest tokens so far (ties: lowest rank), each
    rank's indices in ascending order. With at least ``world_size`` entries every rank gets
    one. Raises ValueError for ``world_size < 1``."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    loads = [0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for index in sorted(range(len(tokens)), key=lambda i: (-int(tokens[i]), i)):
        rank = min(range(world_size), key=lambda r: (len(shares[r]) > 0, loads[r], r))
        shares[rank].append(index)
        loads[rank] += int(tokens[index])
    return [sorted(share) for share in shares]


class _Scorer(torch.nn.Module):
    """The causal LM behind one module whose ``forward`` is the scoring, so FSDP's root hooks
    gather the embedding, final norm and output head around it."""

    def __init__(self, lm: Any, *, pack: bool = False) -> None:
        super().__init__()
        self.lm, self.pack = lm, pack

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                responses: torch.Tensor, response_positions: torch.Tensor,
                temperatures: Sequence[float], chunk_size: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # The temperatures come as plain numbers: FSDP's mixed precision casts floating
        # tensor inputs to bfloat16, which would turn 0.7 into 0.6992.
        part = types.SimpleNamespace(
            input_ids=input_ids, attention_mask=attention_mask, responses=responses,
            response_positions=response_positions,
            temperatures=torch.tensor(temperatures, dtype=torch.float64, device=input_ids.device))
        score = packed_response_log_probs if self.pack else response_log_probs
        log_probs, entropies = score(self.lm, cast(TrainingBatch, part), chunk_size=chunk_size)
        # FSDP hooks its backward onto the outputs; views of a larger tensor would lose it.
        return log_probs.clone(), entropies.clone()


def _decoder_layers(lm: Any) -> list[torch.nn.Module]:
    layers = getattr(getattr(lm, "base_model", None), "layers", None)
    return list(layers) if isinstance(layers, torch.nn.ModuleList) else []


def checkpoint_activations(lm: Any) -> int:
    """Recompute each decoder layer's activations in the backward pass instead of keeping
    them (``torch.utils.checkpoint``, non-reentrant): memory for one layer's activations
    instead of all, for about one more forward. Works with and without FSDP, in eval mode
    too, and leaves parameter names alone. Returns how many layers it wrapped (0 when the
    model has no ``base_model.layers``); wrapping twice is a no-op."""
    from torch.utils.checkpoint import checkpoint

    wrapped = 0
    for layer in _decoder_layers(lm):
        if getattr(layer, "_trajstore_checkpointed", False):
            continue
        inner = layer.forward

        def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        layer.forward = forward
        setattr(layer, "_trajstore_checkpointed", True)  # noqa: B010 (Module's typed __setattr__)
        wrapped += 1
    return wrapped


def shard_model(lm: Any, *, bf16: bool = False, pack: bool = False,
                activation_checkpointing: bool = False) -> torch.nn.Module:
    """Shard ``lm`` (a causal LM) with FSDP2 across the default process group: each decoder
    layer is one unit, the rest (embedding, final norm, head) the root. Returns the root
    module, whose ``forward`` scores a batch; ``lm``'s parameters become DTensors in place.
    ``bf16`` computes in bfloat16 and reduces gradients in float32; ``pack`` scores
    micro-batches packed, without padding (:mod:`workers.trainer.packing`);
    ``activation_checkpointing`` applies :func:`checkpoint_activations`. Raises
    RuntimeError when no process group is initialised."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        raise RuntimeError("shard_model needs an initialised process group (run under torchrun)")
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if bf16 else MixedPrecisionPolicy())
    if activation_checkpointing:
        checkpoint_activations(lm)
    root = _Scorer(lm, pack=pack)
    for layer in _decoder_layers(lm):
        fully_shard(layer, mp_policy=policy)
    # The root too gives its gathered parameters back after each forward: a no-grad forward
    # (the old log-probs) has no backward that would, and the optimizer must see the shards.
    fully_shard(root, mp_policy=policy, reshard_after_forward=True)
    return root


@dataclass
class RankSharding:
    """This rank's part of a data-parallel update (:class:`workers.trainer.ppo.Sharding`)."""

    root: torch.nn.Module
    rank: int
    world_size: int

    def micro_batches(self, batch: TrainingBatch, rows: list[int], *, size: int
                      ) -> Iterator[tuple[list[int], TrainingBatch]]:
        """This rank's token-balanced share of ``rows`` in micro-batches of at most ``size``,
        then zero-weighted ones (a row with an empty loss mask) until every rank has run as
        many as the busiest."""
        tokens = batch.attention_mask[rows].sum(dim=1).tolist()
        shares = balanced_split(tokens, self.world_size)
        count = max(math.ceil(len(share) / size) for share in shares)
        mine = [rows[i] for i in shares[self.rank]]
        done = 0
        for part_rows, part in micro_batches(batch, mine, size=size):
            done += 1
            yield part_rows, part
        for _ in range(count - done):
            idle = next(micro_batches(batch, rows[:1], size=1))[1]
            yield rows[:1], dataclasses.replace(
                idle, response_mask=torch.zeros_like(idle.response_mask))

    def log_probs(self, model: Any, batch: TrainingBatch, *, chunk_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Score ``batch`` through the sharded root (``model`` is its causal LM)."""
        result = self.root(batch.input_ids, batch.attention_mask, batch.responses,
                           batch.response_positions, tuple(batch.temperatures.tolist()),
                           chunk_size)
        return cast(tuple[torch.Tensor, torch.Tensor], result)


@torch.no_grad()
def _score(sharding: RankSharding, batch: TrainingBatch, config: TrainerConfig
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole-batch log-probs and entropies (zeros on padding), each row scored on one rank."""
    shape = tuple(batch.responses.shape)
    log_probs = torch.zeros(shape, dtype=torch.float32, device=batch.responses.device)
    entropies = torch.zeros_like(log_probs)
    for rows, part in sharding.micro_batches(batch, list(range(len(batch))),
                                             size=config.micro_batch_size):
        lp, ent = sharding.log_probs(None, part, chunk_size=config.logit_chunk_size)
        width = lp.shape[1]
        index = torch.tensor(rows, device=log_probs.device)
        log_probs[index, :width] += lp.float() * part.response_mask
        entropies[index, :width] += ent.float() * part.response_mask
    cast(Any, sharding.root).reshard()
    dist.all_reduce(log_probs)
    dist.all_reduce(entropies)
    return log_probs, entropies


def _reduce_stats(stats: PPOStats, world_size: int, device: torch.device) -> None:
    """Sum the ranks' token-weighted metric sums and token counts; the loss terms (each rank's
    scaled by ``world_size``) sum to ``world_size`` times the whole batch's."""
    names = sorted(stats.token_sums), sorted(stats.loss_sums)
    packed = torch.tensor([stats.tokens] + [stats.token_sums[n] for n in names[0]]
                          + [stats.loss_sums[n] for n in names[1]], dtype=torch.float64,
                          device=device)
    dist.all_reduce(packed)
    values = packed.tolist()
    stats.tokens = values[0]
    stats.token_sums = dict(zip(names[0], values[1:1 + len(names[0])], strict=True))
    stats.loss_sums = {name: value / world_size
                       for name, value in zip(names[1], values[1 + len(names[0]):], strict=True)}


def _broadcast(value: Any, *, src: int = 0) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


class _Consolidated:
    """``save_pretrained`` of a sharded causal LM with its gathered full state dict."""

    def __init__(self, lm: Any, state_dict: dict[str, torch.Tensor]) -> None:
        self.lm, self.state_dict = lm, state_dict

    def save_pretrained(self, path: str | os.PathLike[str]) -> None:
        self.lm.save_pretrained(path, state_dict=self.state_dict)


class _Offline:
    """The store seen by ranks other than 0, which never use it."""

    db = None


#: The hooks of a distributed step are the step's own (``after_batch`` runs in every rank).
DistributedHooks = StepHooks


class Ranks:
    """The distribution strategy of a data-parallel step (module docstring): rank 0 leases
    and broadcasts the batch, every rank scores and trains its rows of each mini-batch
    (:class:`RankSharding`), the statistics are summed, the full state dict is gathered and
    rank 0 records the consolidated checkpoint and acknowledges; every rank ends with the
    same result, or the same error."""

    def __init__(self, sharding: RankSharding, reference: RankSharding | None) -> None:
        self.sharding: RankSharding = sharding
        self.reference = reference
        self.rank = sharding.rank

    def take(self, trainer: Trainer, hooks: StepHooks) -> Taken:
        payload: Any = None
        taken: Taken | None = None
        if self.rank == 0:
            try:
                taken = trainer.lease_and_pad(hooks)
                payload = ("taken", dataclasses.replace(taken, lease=None))
            except BaseException as exc:  # every rank must hear of it
                payload = ("error", exc)
        payload = _broadcast(payload)
        if payload[0] == "error":
            raise payload[1]
        return taken if taken is not None else cast(Taken, payload[1])

    def score(self, trainer: Trainer
              ) -> tuple[Callable[[Any, TrainingBatch], tuple[torch.Tensor, torch.Tensor]],
                         Any, Any]:
        config = trainer.config

        def score(sharding: RankSharding, batch: TrainingBatch
                  ) -> tuple[torch.Tensor, torch.Tensor]:
            return _score(sharding, batch, config)

        return score, self.sharding, self.reference

    def reduce(self, stats: PPOStats, device: torch.device) -> None:
        _reduce_stats(stats, self.sharding.world_size, device)

    def record(self, trainer: Trainer, taken: Taken, metrics: Callable[[], dict[str, float]],
               hooks: StepHooks) -> tuple[int, Path | str, dict[str, float]]:
        ranked = cast(DistributedTrainer, trainer)
        full = ranked._full_state_dict()
        optimizer_dir = ranked._save_optimizer(tag=taken.tag)
        outcome: Any = None
        if self.rank == 0:
            lease = taken.lease
            assert lease is not None
            try:
                values = metrics()
                values["world_size"] = float(self.sharding.world_size)
                version, path = ranked._record_consolidated(full, values, lease,
                                                            optimizer_dir)
                trainer.weights_ahead = False
                if hooks.before_ack is not None:
                    hooks.before_ack(lease)
                if lease.dataset_id is None:
                    trainer.leasing.ack(lease.lease_id, policy_version=version)
                outcome = ("ok", version, str(path), values)
            except BaseException as exc:
                _broadcast(("error", exc))
                raise
        outcome = _broadcast(outcome)
        if outcome[0] == "error":
            raise outcome[1]
        trainer.weights_ahead = False
        _, version, path, values = outcome
        return version, path if checkpoint_urls.is_url(path) else Path(path), values


def _is_causal_lm(folder: Path) -> str | None:
    """None when ``folder`` holds a transformers causal LM config, else the reason."""
    with LOCK:  # transformers' lazy names: one first use at a time
        from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not (folder / "config.json").is_file():
        return f"model folder {str(folder)!r} has no config.json"
    try:
        with LOCK:
            config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as exc:
        return f"model folder {str(folder)!r} does not hold a model config: {exc}"
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return (f"model folder {str(folder)!r} is a {config.model_type!r} model, not a causal "
                f"LM")
    return None


def check_setup(run_config: RunConfig, config: TrainerConfig, *, world_size: int,
                model: str | os.PathLike[str], data_dir: str | os.PathLike[str],
                run_id: str) -> None:
    """Refuse, before any lease, what a distributed training run cannot do: raises ValueError
    with the reason when ``world_size`` is below 1 or above the samples of a step
    (``groups_per_step * group_size``) or of a mini-batch (a rank would have nothing to
    train), when ``model`` is not a folder holding a causal LM config, when the run's
    checkpoint folder (under ``config.checkpoint_root``, else under ``data_dir``) cannot be
    created and written, or when a ``checkpoint_root`` URL's protocol is unknown or it cannot
    be written."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size must be a positive integer, got {world_size!r}")
    per_step = config.groups_per_step * run_config.group_size
    if world_size > per_step:
        raise ValueError(
            f"world size {world_size} cannot be fed: a step leases {config.groups_per_step} "
            f"group(s) of {run_config.group_size} = {per_step} samples; raise groups_per_step "
            f"or use at most {per_step} processes")
    if config.mini_batch_size is not None and world_size > config.mini_batch_size:
        raise ValueError(f"world size {world_size} cannot be fed: a mini-batch has "
                         f"{config.mini_batch_size} samples")
    folder = Path(model)
    if not folder.is_dir():
        raise ValueError(f"model folder {str(folder)!r} does not exist")
    reason = _is_causal_lm(folder)
    if reason:
        raise ValueError(reason)
    root = config.checkpoint_root
    if checkpoint_urls.is_url(root):
        checkpoint_urls.check_writable(str(root))
    target = checkpoint_dir(data_dir, run_id, version=0).parent
    if root is not None and not checkpoint_urls.is_url(root):
        target = Path(root).expanduser() / target.name
    probe = target / f".write-check-{uuid.uuid4().hex[:8]}"
    try:
        target.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"checkpoint location {str(target)!r} cannot be written: {exc}"
                         ) from None


class DistributedTrainer(Trainer):
    """One rank of a data-parallel trainer (module docstring). Build it with :meth:`open`
    on every rank of an initialised process group."""

    root: torch.nn.Module
    sharding: RankSharding

    @classmethod
    def open(cls, store: EventStore | None, run_id: str, *,  # type: ignore[override]
             config: TrainerConfig | None = None,
             data_dir: str | os.PathLike[str] | None = None, model: str | None = None,
             name: str | None = None, bf16: bool = False, pack: bool = False,
             activation_checkpointing: bool = False, **_: Any) -> DistributedTrainer:
        """Collective: every rank calls it (``store`` is needed on rank 0 only). Rank 0 reads
        the run, checks the setup (:func:`check_setup`) and finds the newest checkpoint; every
        rank loads those weights and shards them. Raises on every rank the ValueError or
        ``store.errors.NotFoundError`` that rank 0 met (unknown run, no model, a world size
        the batch cannot feed, not a causal LM, an unwritable checkpoint location)."""
        from workers.engines.tokenizers import load_tokenizer

        config = config or TrainerConfig()
        rank, world = dist.get_rank(), dist.get_world_size()
        plan: dict[str, Any] | BaseException
        if rank == 0:
            try:
                assert store is not None, "rank 0 needs the store"
                run = store.get_run(run_id)
                initial = model or run.config.model
                if initial is None:
                    raise ValueError(f"run {run_id!r} names no model (RunConfig.model); "
                                     f"pass model=")
                folder = Path(data_dir) if data_dir else store.settings.data_dir
                if config.checkpoint_root is None and store.settings.checkpoint_root:
                    config = config.replace(checkpoint_root=store.settings.checkpoint_root)
                check_setup(run.config, config, world_size=world, model=initial,
                            data_dir=folder, run_id=run_id)
                resume = _latest_checkpoint(store, run_id,
                                            cache_dir=folder / checkpoint_urls.CHECKPOINT_CACHE)
                plan = {"run_config": run.config, "initial": str(Path(initial).absolute()),
                        "resume": str(resume) if resume else None, "data_dir": str(folder),
                        "step": int(read_state(resume).get("step", 0)) if resume else 0}
            except BaseException as exc:  # every rank must hear of it
                plan = exc
        else:
            plan = {}
        plan = _broadcast(plan)
        if isinstance(plan, BaseException):
            raise plan
        device = torch.device(config.device or "cpu")
        torch.manual_seed(config.seed)
        lm = load_model(plan["resume"] or plan["initial"], device=device, dtype=config.dtype)
        root = shard_model(lm, bf16=bf16, pack=pack,
                           activation_checkpointing=activation_checkpointing)
        reference_sharding = None
        if config.kl_coef > 0:
            reference_lm = load_model(plan["initial"], device=device, dtype=config.dtype)
            reference_lm.requires_grad_(False)
            reference_sharding = RankSharding(shard_model(reference_lm, bf16=bf16, pack=pack),
                                              rank, world)
        run_config: RunConfig = plan["run_config"]
        tokenizer = load_tokenizer(run_config.tokenizer_name or plan["initial"])
        trainer = cls(store=store if rank == 0 and store is not None
                      else cast(EventStore, _Offline()),
                      run_id=run_id, run_config=run_config, model=lm, tokenizer=tokenizer,
                      config=config, data_dir=Path(plan["data_dir"]), device=device,
                      step=plan["step"], name=name, initial_model=plan["initial"])
        trainer.root = root
        trainer.sharding = RankSharding(root, rank, world)
        trainer.distribution = Ranks(trainer.sharding, reference_sharding)
        if plan["resume"]:
            trainer._load_optimizer(Path(plan["resume"]))
        return trainer

    @property
    def rank(self) -> int:
        return self.sharding.rank

    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the model's full state dict on rank 0 (CPU, Hugging Face names), empty
        elsewhere."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.root, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))
        return {name.removeprefix("lm."): cast(torch.Tensor, tensor)
                for name, tensor in state.items()}

    def _save_optimizer(self, *, tag: str) -> Path:
        """Collective: every rank writes its optimizer shard with
        ``torch.distributed.checkpoint`` into a staging folder beside the run's checkpoints,
        which rank 0 moves into the checkpoint folder; returns the staging folder."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        staging = (checkpoint_dir(self.data_dir, self.run_id, version=0).parent
                   / f".{OPTIMIZER_DIR}-{tag}")
        if self.rank == 0 and staging.exists():
            shutil.rmtree(staging)
        dist.barrier()
        dcp.save({"optimizer": get_optimizer_state_dict(self.root, self.optimizer)},
                 checkpoint_id=str(staging))
        return staging

    def _load_optimizer(self, folder: Path) -> bool:
        """Collective: restore the optimizer from a checkpoint's ``OPTIMIZER_DIR`` (False,
        nothing changed, when the checkpoint has none: one of the single-process trainer)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        if not (folder / OPTIMIZER_DIR).is_dir():
            return False
        state = {"optimizer": get_optimizer_state_dict(self.root, self.optimizer)}
        dcp.load(state, checkpoint_id=str(folder / OPTIMIZER_DIR))
        set_optimizer_state_dict(self.root, self.optimizer, optim_state_dict=state["optimizer"])
        config = self.config
        for group in self.optimizer.param_groups:  # the configured settings win
            group.update(lr=config.lr, betas=config.betas, eps=config.adam_eps,
                         weight_decay=config.weight_decay)
        return True

    def _record_consolidated(self, state_dict: dict[str, torch.Tensor],
                             metrics: dict[str, float], lease: Lease,
                             optimizer_dir: Path) -> tuple[int, Path | str]:
        """Rank 0: save the consolidated checkpoint and append ``policy_updated`` under the
        next free version (retrying on a race, as :meth:`Trainer._record`)."""
        model = _Consolidated(self.model, state_dict)
        while True:
            version = self.leasing.current_policy_version(self.run_id) + 1
            local, url = self._checkpoint_target(version, lease.lease_id.hex[:8])
            path = save_checkpoint(
                local, model=model, tokenizer=self.tokenizer,
                state={**self._state(version, metrics),
                       "world_size": self.sharding.world_size})
            # shutil.move: a checkpoint root may be on another file system than the staging.
            shutil.move(optimizer_dir, path / OPTIMIZER_DIR)
            if url is not None:
                try:
                    checkpoint_urls.upload(path, url)
                except BaseException:
                    shutil.rmtree(path, ignore_errors=True)
                    raise
            if append_policy_updated(self.store, self.run_id, PolicyUpdated(
                    version=version, step=self.steps_done, metrics=metrics,
                    checkpoint=url or str(path), trained=trained_samples(lease))) is None:
                if url is not None:
                    checkpoint_urls.remove(url)
                shutil.move(path / OPTIMIZER_DIR, optimizer_dir)
                shutil.rmtree(path, ignore_errors=True)
                continue
            if url is not None:
                shutil.rmtree(path, ignore_errors=True)
                checkpoint_urls.prune(url.rsplit("/", 1)[0], keep=self.config.keep_checkpoints)
                return version, url
            prune_checkpoints(path.parent, keep=self.config.keep_checkpoints)
            return version, path


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="torchrun ... -m workers.trainer.distributed",
        description="One rank of a distributed trainer (run under torchrun). SPEC is one JSON "
                    "object (torchrun would take options such as --run as its own): run (the "
                    "run id, required), steps (1), wait (seconds, 0), model, data_dir, bf16 "
                    "(false), pack (false: score micro-batches packed, without padding), "
                    "activation_checkpointing (false) and config (TrainerConfig fields).")
    parser.add_argument("spec")
    spec = json.loads(parser.parse_args(argv).spec)
    if not isinstance(spec, dict) or not isinstance(spec.get("run"), str):
        parser.error("SPEC must be a JSON object with a string 'run'")
    return argparse.Namespace(run=spec["run"], steps=int(spec.get("steps", 1)),
                              wait=float(spec.get("wait", 0.0)), model=spec.get("model"),
                              data_dir=spec.get("data_dir"), bf16=bool(spec.get("bf16", False)),
                              pack=bool(spec.get("pack", False)),
                              activation_checkpointing=bool(
                                  spec.get("activation_checkpointing", False)),
                              config=dict(spec.get("config", {})))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of each rank under ``torchrun``: train ``--steps`` steps of ``--run``.
    Rank 0 prints one JSON line per trained step. Returns the exit status (1 with the reason
    on stderr for a refused setup)."""
    from store import errors
    from store.settings import get_settings

    args = _parse(argv)

    def stop(signum: int, _frame: Any) -> None:  # torchrun stops the group with SIGTERM
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    fields = args.config
    if "betas" in fields:
        fields["betas"] = tuple(fields["betas"])
    config = TrainerConfig(**fields)
    if (config.device or "cpu").startswith("cuda"):  # one GPU per rank (never run yet)
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        config = config.replace(device=f"cuda:{local}")
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    store = None
    try:
        if dist.get_rank() == 0:
            store = EventStore.open(get_settings())
        try:
            trainer = DistributedTrainer.open(store, args.run, config=config,
                                              data_dir=args.data_dir, model=args.model,
                                              bf16=args.bf16, pack=args.pack,
                                              activation_checkpointing=args.activation_checkpointing)
        except (errors.NotFoundError, ValueError) as exc:
            if dist.get_rank() == 0:
                print(f"error: {exc}", file=sys.stderr, flush=True)
            return 1
        done = 0
        while done < args.steps:
            deadline = time.monotonic() + args.wait
            # Rank 0's clock decides whether to poll again, so every rank calls step() alike.
            while not (result := trainer.step()).trained and _broadcast(
                    time.monotonic() < deadline if dist.get_rank() == 0 else None):
                time.sleep(1.0)
            if not result.trained:
                break
            done += 1
            if dist.get_rank() == 0:
                print(json.dumps({"version": result.version, "step": result.step,
                                  "samples": result.samples, "checkpoint": str(result.checkpoint),
                                  "pg_loss": result.metrics.get("pg_loss")}), flush=True)
        # Every rank leaves together: none tears its connections down while another still
        # sends.
        dist.barrier()
        return 0
    finally:
        if store is not None:
            store.close()
        dist.destroy_process_group()


def exit_rank(code: int) -> NoReturn:
    """End a rank's process with ``code`` once its work is done and its process group
    destroyed, without the interpreter's teardown: gloo's and the rendezvous store's native
    threads can still be running when Python finalises, and a rank then aborts ("terminate
    called without an active exception") after it has finished, which torchrun reports as
    a failed run."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_rank(main())
