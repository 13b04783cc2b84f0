"""Sequence packing: a micro-batch's samples scored as one row, without padding.

Right-padded rows ``(bs, seq)`` spend compute on padding up to the longest sample. Packed, the
real tokens of every row are concatenated into one ``(1, total)`` sequence whose position ids
restart at 0 for each sample; with no attention mask, transformers builds the block-diagonal
causal mask from the restarting position ids, so no token attends across samples. The final
hidden states are gathered back at each sample's response positions, and log-probs and
entropies come out in the same ``(bs, response_length)`` layout as
:func:`workers.trainer.policy.response_log_probs`, equal to it within float rounding.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from workers.trainer.batch import TrainingBatch
from workers.trainer.logits import DEFAULT_CHUNK_SIZE, logprobs_and_entropy_from_hidden
from workers.trainer.policy import output_head
from workers.trainer.ppo import micro_batches

__all__ = ["PackedScoring", "packed_response_log_probs"]


def packed_response_log_probs(
    model: Any,
    batch: TrainingBatch,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~workers.trainer.policy.response_log_probs` computed on the packed batch (module
    docstring): same arguments, same results and errors. The batch must be right-padded (its
    attention mask ones then zeros on every row), as :func:`~workers.trainer.batch.pad_samples`
    makes it; raises ValueError otherwise."""
    backbone, weight, bias = output_head(model)
    mask = batch.attention_mask.bool()
    lengths = mask.sum(dim=1)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    if bool((mask != (positions < lengths.unsqueeze(1))).any()):
        raise ValueError("packing needs right-padded rows (attention_mask ones, then zeros)")
    starts = torch.cumsum(lengths, dim=0) - lengths
    input_ids = batch.input_ids[mask].unsqueeze(0)  # (1, total), samples in row order
    total = input_ids.shape[1]
    position_ids = (torch.arange(total, device=mask.device)
                    - torch.repeat_interleave(starts, lengths)).unsqueeze(0)
    hidden = backbone(input_ids=input_ids, position_ids=position_ids,
                      use_cache=False).last_hidden_state[0]  # (total, hidden)
    # Padding entries of response_positions point past a short sample; they are masked out of
    # every loss, so any valid index will do.
    index = (starts.unsqueeze(1) + batch.response_positions).clamp(max=total - 1)
    return logprobs_and_entropy_from_hidden(
        hidden[index], weight, batch.responses, temperature=batch.temperatures,
        chunk_size=chunk_size, lm_head_bias=bias)


@dataclass(frozen=True)
class PackedScoring:
    """A one-process :class:`workers.trainer.ppo.Sharding` that scores packed micro-batches:
    ``ppo_update(..., sharding=PackedScoring())`` trains without padding."""

    world_size: int = 1

    def micro_batches(self, batch: TrainingBatch, rows: list[int], *, size: int
                      ) -> Iterable[tuple[list[int], TrainingBatch]]:
        return micro_batches(batch, rows, size=size)

    def log_probs(self, model: Any, batch: TrainingBatch, *, chunk_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        return packed_response_log_probs(model, batch, chunk_size=chunk_size)
