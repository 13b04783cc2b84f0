"""Pushing the trainer's weights to a rollout engine after a policy update.

Any :class:`~workers.engines.backend.WeightUpdatable` backend takes them: the in-process
transformers backend copies tensors into its model, the vLLM backend calls its workers'
``reload_weights``. Names are the model's state-dict names, which are the checkpoint's names
for Hugging Face models, so an engine that loaded the same checkpoint folder knows them all.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from workers.engines.backend import WeightUpdatable

__all__ = ["named_weights", "push_weights"]


def named_weights(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every entry of ``model``'s state dict, detached, in order.
    Raises TypeError when ``model`` has no ``state_dict``."""
    state_dict = getattr(model, "state_dict", None)
    if not callable(state_dict):
        raise TypeError(f"model must be a torch module, got {type(model).__name__}")
    for name, tensor in state_dict().items():
        yield name, tensor.detach()


def push_weights(model: Any, engine: WeightUpdatable, *, version: int) -> int:
    """Load ``model``'s weights into ``engine`` as policy ``version``; returns how many
    tensors were sent. Raises TypeError when ``engine`` cannot take weights
    (no ``update_weights``) or ``version`` is not an integer, ValueError for a negative
    ``version``; the engine raises for names or shapes it does not know."""
    if not isinstance(engine, WeightUpdatable):
        raise TypeError(f"engine must have update_weights(weights, *, version), "
                        f"got {type(engine).__name__}")
    if isinstance(version, bool) or not isinstance(version, int):
        raise TypeError(f"version must be an integer, got {version!r}")
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    weights = list(named_weights(model))
    with torch.no_grad():
        engine.update_weights(weights, version=version)
    return len(weights)
