"""Padding leased samples into the tensors a training step works on.

A sample is one token sequence ``(num_tokens,)`` with a loss mask and rollout log-probs; its
*response* is everything from ``prompt_length`` on (the first trainable token), so in a
multi-turn sample the response also holds tool results and other context, masked out of the
loss. Sequences are right-padded to ``(bs, seq)``; the responses are gathered into
``(bs, response_length)`` tensors (``response_length`` the longest response of the batch).
``response_positions[i, j]`` is the position in ``input_ids`` whose next-token distribution
scores ``responses[i, j]`` (``prompt_length_i - 1 + j``), so the model is run once over the
padded sequences and its hidden states are gathered at those positions.

Right padding keeps every real token at its natural position (no position ids to rebuild)
and, under causal attention, pad tokens after a sequence cannot change it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Protocol

import numpy as np
import torch

__all__ = ["SampleLike", "TrainingBatch", "pad_samples", "token_level_rewards"]


class SampleLike(Protocol):
    """What :func:`pad_samples` reads from a sample (``store.leasing.LeasedSample`` fits)."""

    @property
    def sample_id(self) -> int: ...
    @property
    def group_id(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def reward(self) -> float: ...
    @property
    def policy_version(self) -> int | None: ...
    @property
    def prompt_length(self) -> int: ...
    @property
    def token_ids(self) -> np.ndarray: ...
    @property
    def loss_mask(self) -> np.ndarray: ...
    @property
    def logprobs(self) -> np.ndarray: ...


@dataclass(frozen=True)
class TrainingBatch:
    """The padded tensors of one batch of samples (see the module docstring).

    ``input_ids`` and ``attention_mask`` ``(bs, seq)`` int64; ``responses`` and
    ``response_positions`` ``(bs, response_length)`` int64; ``response_mask`` and
    ``rollout_log_probs`` ``(bs, response_length)`` float32 (mask 1 on trainable tokens, log-probs
    0 elsewhere); ``response_lengths`` ``(bs,)`` int64 (real response tokens of each row);
    ``temperatures`` ``(bs,)`` float64, the temperature each row's logits are divided by when
    it is scored (the one it was sampled at, :mod:`workers.trainer.temperature`);
    ``rewards`` ``(bs,)`` float32; ``is_negative`` ``(bs,)`` bool; ``group_ids``,
    ``sample_ids``, ``policy_versions`` and ``episode_ids`` one entry per row (a sample that
    names no episode gets ``"sample:<id>"``).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    responses: torch.Tensor
    response_positions: torch.Tensor
    response_mask: torch.Tensor
    response_lengths: torch.Tensor
    rollout_log_probs: torch.Tensor
    temperatures: torch.Tensor
    rewards: torch.Tensor
    is_negative: torch.Tensor
    group_ids: tuple[str, ...]
    sample_ids: tuple[int, ...]
    policy_versions: tuple[int | None, ...]
    episode_ids: tuple[str, ...] = ()

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_trainable_tokens(self) -> int:
        """Tokens under the loss mask."""
        return int(self.response_mask.sum().item())

    def select(self, rows: Sequence[int] | torch.Tensor) -> TrainingBatch:
        """The batch of the given rows, in that order (padding is kept as is). Raises
        IndexError for a row outside ``[0, len(self))``."""
        index = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= len(self)):
            raise IndexError(f"rows must lie in [0, {len(self)}), got {index.tolist()}")
        picked = index.tolist()
        values: dict[str, object] = {}
        for item in fields(self):
            value = getattr(self, item.name)
            if isinstance(value, torch.Tensor):
                values[item.name] = value[index.to(value.device)]
            else:
                values[item.name] = tuple(value[i] for i in picked)
        return TrainingBatch(**values)  # type: ignore[arg-type]

    def to(self, device: torch.device | str) -> TrainingBatch:
        """The same batch with every tensor on ``device``."""
        values = {
            item.name: (getattr(self, item.name).to(device)
                        if isinstance(getattr(self, item.name), torch.Tensor)
                        else getattr(self, item.name))
            for item in fields(self)
        }
        return TrainingBatch(**values)  # type: ignore[arg-type]


def _array(sample: SampleLike, index: int, name: str) -> np.ndarray:
    value = np.asarray(getattr(sample, name))
    if value.ndim != 1:
        raise ValueError(f"samples[{index}].{name} must be one-dimensional (num_tokens,), "
                         f"got shape {value.shape}")
    return value


def _check_sample(sample: SampleLike, index: int, vocab_size: int | None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, float]:
    ids = _array(sample, index, "token_ids")
    mask = _array(sample, index, "loss_mask")
    logprobs = _array(sample, index, "logprobs")
    if ids.dtype.kind not in "iu":
        raise TypeError(f"samples[{index}].token_ids must hold integers, got dtype {ids.dtype}")
    if not len(ids) == len(mask) == len(logprobs):
        raise ValueError(
            f"samples[{index}] has {len(ids)} token_ids, {len(mask)} loss_mask entries and "
            f"{len(logprobs)} logprobs; they must be equal")
    if len(ids) and (int(ids.min()) < 0
                     or (vocab_size is not None and int(ids.max()) >= vocab_size)):
        raise ValueError(f"samples[{index}].token_ids must lie in [0, {vocab_size}), got "
                         f"values in [{int(ids.min())}, {int(ids.max())}]")
    if not np.isin(mask, (0, 1)).all():
        raise ValueError(f"samples[{index}].loss_mask must hold only 0 and 1")
    prompt_length = sample.prompt_length
    if isinstance(prompt_length, bool) or not isinstance(prompt_length, int | np.integer):
        raise TypeError(f"samples[{index}].prompt_length must be an integer, "
                        f"got {prompt_length!r}")
    if not 1 <= prompt_length <= len(ids):
        raise ValueError(f"samples[{index}].prompt_length must be in [1, {len(ids)}] (a "
                         f"token must precede the response), got {prompt_length}")
    if mask[:prompt_length].any():
        raise ValueError(f"samples[{index}].loss_mask is 1 before prompt_length "
                         f"{prompt_length}; the prompt is never trained")
    reward = sample.reward
    if isinstance(reward, bool) or not isinstance(reward, int | float | np.floating):
        raise TypeError(f"samples[{index}].reward must be a number, got {reward!r}")
    if not math.isfinite(float(reward)):
        raise ValueError(f"samples[{index}].reward must be finite, got {reward!r}")
    return ids, mask, logprobs, int(prompt_length), float(reward)


def pad_samples(
    samples: Sequence[SampleLike],
    *,
    pad_token_id: int,
    vocab_size: int | None = None,
    temperatures: float | Sequence[float] = 1.0,
) -> TrainingBatch:
    """Pad ``samples`` into a :class:`TrainingBatch` on the CPU, rows in the given order.

    ``pad_token_id`` fills the padding (never attended to nor trained). With ``vocab_size`` the
    token ids are checked against it. ``temperatures`` are the scoring temperatures, one for
    every row or one per sample.

    Raises ValueError for an empty ``samples``, a negative ``pad_token_id``, temperatures
    that are not finite and positive or not one per sample, and
    TypeError/ValueError naming the sample and field for arrays that are not 1-D or differ in
    length, non-integer or out-of-vocabulary token ids, a loss mask other than 0/1 or set
    inside the prompt, a ``prompt_length`` outside ``[1, num_tokens]``, and a non-finite or
    non-numeric reward.
    """
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or pad_token_id < 0:
        raise ValueError(f"pad_token_id must be a non-negative integer, got {pad_token_id!r}")
    if len(samples) == 0:
        raise ValueError("samples must not be empty")
    checked = [_check_sample(sample, i, vocab_size) for i, sample in enumerate(samples)]
    bs = len(checked)
    temps = _temperatures(temperatures, bs)
    seq = max(len(ids) for ids, *_ in checked)
    response_length = max(max(len(ids) - prompt for ids, _, _, prompt, _ in checked), 1)

    input_ids = torch.full((bs, seq), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((bs, seq), dtype=torch.long)
    responses = torch.full((bs, response_length), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((bs, response_length), dtype=torch.float32)
    rollout_log_probs = torch.zeros((bs, response_length), dtype=torch.float32)
    response_lengths = torch.zeros(bs, dtype=torch.long)
    prompt_lengths = torch.zeros(bs, dtype=torch.long)
    for row, (ids, mask, logprobs, prompt, _) in enumerate(checked):
        n = len(ids)
        input_ids[row, :n] = torch.from_numpy(ids.astype(np.int64))
        attention_mask[row, :n] = 1
        length = n - prompt
        responses[row, :length] = input_ids[row, prompt:n]
        response_mask[row, :length] = torch.from_numpy(mask[prompt:].astype(np.float32))
        rollout_log_probs[row, :length] = torch.from_numpy(
            logprobs[prompt:].astype(np.float32)) * response_mask[row, :length]
        response_lengths[row] = length
        prompt_lengths[row] = prompt
    # Position t's next-token distribution scores token t + 1; padding rows point anywhere
    # valid (they are masked), so clamp into the sequence.
    offsets = torch.arange(response_length, dtype=torch.long).unsqueeze(0)
    response_positions = (prompt_lengths.unsqueeze(1) - 1 + offsets).clamp(max=seq - 1)
    return TrainingBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        responses=responses,
        response_positions=response_positions,
        response_mask=response_mask,
        response_lengths=response_lengths,
        rollout_log_probs=rollout_log_probs,
        temperatures=temps,
        rewards=torch.tensor([reward for *_, reward in checked], dtype=torch.float32),
        is_negative=torch.tensor([s.kind == "negative" for s in samples], dtype=torch.bool),
        group_ids=tuple(str(s.group_id) for s in samples),
        sample_ids=tuple(int(s.sample_id) for s in samples),
        policy_versions=tuple(s.policy_version for s in samples),
        episode_ids=tuple(str(getattr(s, "episode_id", None) or f"sample:{int(s.sample_id)}")
                          for s in samples),
    )


def _temperatures(temperatures: float | Sequence[float], bs: int) -> torch.Tensor:
    values = ([temperatures] * bs if isinstance(temperatures, int | float)
              else list(temperatures))
    if len(values) != bs:
        raise ValueError(f"temperatures must be one number or one per sample ({bs}), got "
                         f"{len(values)}")
    for index, value in enumerate(values):
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or not math.isfinite(value) or value <= 0):
            raise ValueError(f"temperatures[{index}] must be a finite number > 0, got "
                             f"{value!r}")
    # float64: the number a run or an episode recorded, exactly (0.7, not float32's 0.69999999).
    return torch.tensor(values, dtype=torch.float64)


def token_level_rewards(
    rewards: torch.Tensor, response_mask: torch.Tensor, *, response_lengths: torch.Tensor
) -> torch.Tensor:
    """Each row's scalar reward placed on its last trainable response token,
    ``(bs, response_length)`` (zeros elsewhere); a row with no trainable token gets it on its
    last response token (position 0 for an empty response).

    ``rewards`` and ``response_lengths`` are ``(bs,)``, ``response_mask`` ``(bs,
    response_length)``. Raises ValueError when the shapes disagree.
    """
    if rewards.dim() != 1 or response_lengths.shape != rewards.shape:
        raise ValueError(f"rewards and response_lengths must both have shape (bs,), got "
                         f"{tuple(rewards.shape)} and {tuple(response_lengths.shape)}")
    if response_mask.dim() != 2 or response_mask.shape[0] != rewards.shape[0]:
        raise ValueError(f"response_mask must have shape ({rewards.shape[0]}, "
                         f"response_length), got {tuple(response_mask.shape)}")
    length = response_mask.shape[1]
    positions = torch.arange(length, device=response_mask.device).expand_as(response_mask)
    trainable = response_mask > 0
    last_trainable = torch.where(trainable, positions, -1).amax(dim=1)
    fallback = (response_lengths.to(response_mask.device) - 1).clamp(min=0, max=length - 1)
    last = torch.where(last_trainable >= 0, last_trainable, fallback)
    out = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    out.scatter_(1, last.unsqueeze(1), rewards.to(out.device, torch.float32).unsqueeze(1))
    return out
