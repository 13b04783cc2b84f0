"""Log-probs and entropies of a batch's response tokens under a transformers causal LM.

The backbone runs once over the padded sequences ``(bs, seq)``; its final hidden states are
gathered at the positions that predict the response tokens, ``(bs, response_length, hidden)``,
and the output head is applied chunk by chunk (:mod:`workers.trainer.logits`), so the full
``(bs, seq, vocab)`` logits never exist. Models whose logits are not a plain linear head over
the final hidden states (soft-capping, logit scaling) are refused rather than scored wrongly.
"""

from __future__ import annotations

from typing import Any

import torch

from workers.trainer.batch import TrainingBatch
from workers.trainer.logits import DEFAULT_CHUNK_SIZE, logprobs_and_entropy_from_hidden

__all__ = ["output_head", "response_log_probs"]

# Config attributes of families whose logits are transformed after the head.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def output_head(model: Any) -> tuple[Any, torch.Tensor, torch.Tensor | None]:
    """``(backbone, head weight (vocab, hidden), head bias (vocab,) or None)`` of a causal LM.

    Raises TypeError when ``model`` has no separate backbone or no linear output head, and
    ValueError when its config transforms the logits after the head (the attribute is named).
    """
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise TypeError(f"model must be a causal LM with a linear output head, "
                        f"got {type(model).__name__}")
    backbone = getattr(model, "base_model", None)
    if backbone is None or backbone is model:
        raise TypeError(f"model {type(model).__name__} has no separate backbone (base_model)")
    config = getattr(model, "config", None)
    for name in _LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value not in (None, 1, 1.0):
            raise ValueError(f"model config sets {name}={value!r}: its logits are not a plain "
                             f"linear head, which this trainer does not score")
    bias = getattr(head, "bias", None)
    return backbone, weight, bias if isinstance(bias, torch.Tensor) else None


def response_log_probs(
    model: Any,
    batch: TrainingBatch,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each response token and the entropy of its distribution, both
    ``(bs, response_length)`` float32, under ``model`` with each row's logits divided by its
    ``batch.temperatures`` entry (the temperature it was sampled at).

    Gradients flow to the model when autograd is on (wrap in ``torch.no_grad()`` to recompute
    old log-probs). Values at padded or untrained positions are computed but meaningless; use
    ``batch.response_mask``. The batch must be on the model's device.

    Raises the errors of :func:`output_head` and
    :func:`workers.trainer.logits.logprobs_and_entropy_from_hidden` (bad temperature or chunk
    size, token ids outside the head's vocabulary, non-finite results).
    """
    backbone, weight, bias = output_head(model)
    outputs = backbone(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       use_cache=False)
    hidden = outputs.last_hidden_state  # (bs, seq, hidden)
    index = batch.response_positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
    scoring = hidden.gather(1, index)  # (bs, response_length, hidden)
    return logprobs_and_entropy_from_hidden(
        scoring, weight, batch.responses, temperature=batch.temperatures,
        chunk_size=chunk_size, lm_head_bias=bias)
