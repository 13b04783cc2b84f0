"""One lock for the loads that may be a process's first use of a transformers name.

transformers resolves its names lazily (its ``_LazyModule``): the first ``from transformers
import X`` or ``AutoModelForCausalLM.from_pretrained`` imports the submodule that defines the
name. Two threads doing that at once can see the module half-built; one of them then fails
with ``Could not import module 'Qwen3ForCausalLM'`` while the other was loading a tokenizer.
A process that loads a tokenizer on one thread and a model on another (the demo, a rollout
worker beside its replays) holds :data:`LOCK` around each load, so they happen one after
the other. It is reentrant: a load may call another under it.
"""

from __future__ import annotations

import threading

__all__ = ["LOCK"]

LOCK = threading.RLock()
