"""Benchmark: tokens/s of a training step against a bare forward + backward + optimizer step.

The sides run the same model on the same batch in the same process, back to back, for
``--rounds`` rounds; the ratios are the medians of the per-round ratios:

- **bare** (the ceiling): one ``model(input_ids, attention_mask)`` over the padded batch, a
  cross-entropy on the response tokens from the full logits, ``backward()``, an AdamW step;
- **update**: :func:`workers.trainer.ppo.ppo_update` on the batch (chunked log-probs and
  entropies, the PPO loss, micro-batch gradient accumulation, gradient clipping, AdamW);
- **step**: what :meth:`workers.trainer.loop.Trainer.step` computes between the lease and the
  checkpoint, :func:`workers.trainer.update.update_batch` with the trainer's defaults (GRPO,
  token-level IS correction, one epoch over one mini-batch): the old log-probs come from the
  update's own forward;
- **scored**: the same with ``separate_scoring`` (the old log-probs from a no-grad forward
  first, as verl does, and as the step does with several epochs or mini-batches);
- **packed**: ``ppo_update`` with packed micro-batches
  (:class:`workers.trainer.packing.PackedScoring`: no padding tokens computed).

Samples are variable-length synthetic sequences (prompt then response, uniform lengths in
``--min-tokens``..``--max-tokens``) of ``--samples`` rows in groups of 4, with random rewards.
The model is the tiny Qwen3 (``--hidden 64 --layers 2``) or a wider one built from the same
config (``--hidden``, ``--layers``, random weights; nothing is downloaded). Throughput counts
every non-padding token of the batch.

Run ``python bench/trainer.py`` (about a minute on two cores) or ``--quick``. The last line is
``RESULT step_vs_bare=<x> scored_vs_bare=<s> update_vs_bare=<y> packed_vs_bare=<z>``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from store.events import CorrectionConfig
from workers.engines.tinymodel import tiny_model_path
from workers.trainer.advantages import AdvantageSettings
from workers.trainer.batch import TrainingBatch, pad_samples
from workers.trainer.checkpoint import load_model
from workers.trainer.config import TrainerConfig
from workers.trainer.packing import PackedScoring
from workers.trainer.ppo import ppo_update, score_batch
from workers.trainer.update import update_batch

__all__ = ["main"]


@dataclass(frozen=True)
class _Sample:
    sample_id: int
    group_id: str
    kind: str
    reward: float
    policy_version: int | None
    prompt_length: int
    token_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray


def _build_model(folder: Path, *, hidden: int, layers: int) -> Path:
    """The tiny model, or one of the given width and depth from the tiny model's config."""
    tiny = tiny_model_path(folder)
    if hidden == 64 and layers == 2:
        return tiny
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(tiny))
    config.hidden_size, config.num_hidden_layers = hidden, layers
    config.intermediate_size = hidden * 3
    config.num_attention_heads = max(hidden // 32, 1)
    config.num_key_value_heads = max(hidden // 64, 1)
    config.head_dim = 32
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[0]] * layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    target = folder / f"model-h{hidden}-l{layers}"
    model.save_pretrained(target)
    return target


def _samples(count: int, *, vocab: int, min_tokens: int, max_tokens: int,
             seed: int) -> list[_Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for index in range(count):
        length = int(rng.integers(min_tokens, max_tokens + 1))
        prompt = max(1, length // 3)
        mask = np.zeros(length, dtype=np.int64)
        mask[prompt:] = 1
        out.append(_Sample(index, f"g{index // 4}", "positive", float(rng.random()), 0,
                           prompt, rng.integers(0, vocab, length), mask,
                           -rng.random(length).astype(np.float32) * mask))
    return out


def _bare(model: torch.nn.Module, batch: TrainingBatch, optimizer: torch.optim.Optimizer,
          micro: int) -> None:
    """Forward, cross-entropy on the response tokens, backward and an optimizer step, in the
    same micro-batches as the update."""
    optimizer.zero_grad(set_to_none=True)
    total = batch.response_mask.sum().clamp(min=1)
    for start in range(0, len(batch), micro):
        part = batch.select(list(range(start, min(start + micro, len(batch)))))
        seq = int(part.attention_mask.sum(dim=1).max())
        logits = model(input_ids=part.input_ids[:, :seq],
                       attention_mask=part.attention_mask[:, :seq], use_cache=False).logits
        width = int(part.response_lengths.max())
        positions = part.response_positions[:, :width].clamp(max=seq - 1)
        picked = logits.gather(1, positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
        loss = torch.nn.functional.cross_entropy(
            picked.reshape(-1, picked.shape[-1]), part.responses[:, :width].reshape(-1),
            reduction="none")
        (loss * part.response_mask[:, :width].reshape(-1)).sum().div(total).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def _update(model: torch.nn.Module, batch: TrainingBatch, optimizer: torch.optim.Optimizer,
            config: TrainerConfig, *, fixed: tuple[torch.Tensor, torch.Tensor],
            pack: bool = False) -> None:
    old, advantages = fixed
    ppo_update(model, batch, optimizer=optimizer, old_log_probs=old, advantages=advantages,
               config=config, sharding=PackedScoring() if pack else None)


def _step(model: torch.nn.Module, batch: TrainingBatch, optimizer: torch.optim.Optimizer,
          config: TrainerConfig) -> bool:
    """The trainer's step between lease and checkpoint; whether it skipped the scoring."""
    return update_batch(model, batch, optimizer=optimizer, config=config, estimator="grpo",
                        advantage_settings=AdvantageSettings(),
                        correction=CorrectionConfig()).single_pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--min-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.layers, args.rounds, args.samples = 64, 2, 2, 8
    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as scratch:
        folder = _build_model(Path(scratch), hidden=args.hidden, layers=args.layers)
        model = load_model(folder)
        vocab = int(model.get_output_embeddings().weight.shape[0])
        batch = pad_samples(_samples(args.samples, vocab=vocab, min_tokens=args.min_tokens,
                                     max_tokens=args.max_tokens, seed=0),
                            pad_token_id=0, vocab_size=vocab)
        tokens = int(batch.attention_mask.sum())
        params = sum(p.numel() for p in model.parameters())
        config = TrainerConfig(lr=1e-6, micro_batch_size=args.micro_batch)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
        fixed = score_batch(model, batch, config=config)[0], torch.randn(
            batch.response_mask.shape) * batch.response_mask
        print(f"model: hidden {args.hidden}, {args.layers} layers, {params / 1e6:.1f}M "
              f"parameters; batch: {len(batch)} samples, {tokens} tokens "
              f"(padded {batch.input_ids.numel()}), micro-batch {args.micro_batch}, "
              f"torch threads {torch.get_num_threads()}")
        scored = config.replace(separate_scoring=True)
        if not _step(model, batch, optimizer, config) or _step(model, batch, optimizer, scored):
            raise SystemExit("the step did not take the path this benchmark measures")
        sides = {
            "bare": lambda: _bare(model, batch, optimizer, args.micro_batch),
            "update": lambda: _update(model, batch, optimizer, config, fixed=fixed),
            "step": lambda: _step(model, batch, optimizer, config),
            "scored": lambda: _step(model, batch, optimizer, scored),
            "packed": lambda: _update(model, batch, optimizer, config, fixed=fixed, pack=True),
        }
        for run in sides.values():  # warm-up
            run()
        times: dict[str, list[float]] = {name: [] for name in sides}
        for round_no in range(args.rounds):
            line = []
            for name, run in sides.items():
                started = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - started)
                line.append(f"{name} {tokens / times[name][-1]:,.0f} tok/s")
            print(f"round {round_no + 1}: " + ", ".join(line))
        median = {name: statistics.median(values) for name, values in times.items()}
        for name in sides:
            print(f"{name:>6}: {tokens / median[name]:,.0f} tokens/s "
                  f"({median[name] * 1e3:.0f} ms median)")
        # The machine's load drifts between rounds; each round's sides ran back to back, so
        # the median of the per-round ratios is the steadier figure.
        step_ratio = statistics.median(b / s for b, s in zip(times["bare"], times["step"],
                                                                strict=True))
        scored_ratio = statistics.median(b / s for b, s in zip(times["bare"], times["scored"],
                                                                  strict=True))
        update_ratio = statistics.median(b / u for b, u in zip(times["bare"], times["update"],
                                                                  strict=True))
        packed_ratio = statistics.median(b / p for b, p in zip(times["bare"], times["packed"],
                                                                  strict=True))
        print(f"packed update vs bare {packed_ratio:.2f}x (bare computes the padding)")
        print(f"step vs bare {step_ratio:.2f}x (old log-probs from the update's forward; "
              f"target >= 0.8x), with a separate scoring forward {scored_ratio:.2f}x, "
              f"update alone {update_ratio:.2f}x")
        print(f"RESULT step_vs_bare={step_ratio:.3f} scored_vs_bare={scored_ratio:.3f} "
              f"update_vs_bare={update_ratio:.3f} packed_vs_bare={packed_ratio:.3f}")


if __name__ == "__main__":
    main()
