"""The rollout worker's generation engine, kept in memory between tasks, and its weights.

A rollout worker process builds one backend (``rollout_backend`` setting, a name of
:data:`workers.engines.registry.BACKENDS`) for the base model of the runs it serves, and reuses
it for every group. Before a group it is brought to the run's current policy
(:meth:`RolloutEngine.ensure`):

- version 0 is the base model's own weights (reloaded from its folder when the engine last
  held another run's or version's weights);
- version v > 0 is loaded from the folder that run's ``policy_updated`` names (the trainer's
  checkpoint: ``model.safetensors``), in place, with ``update_weights``; a checkpoint named
  by an fsspec URL is downloaded first into ``<data_dir>/checkpoint-cache`` (once per URL;
  :mod:`workers.checkpoint_urls`);
- a ``policy_updated`` without a checkpoint (or a log that does not tell it, such as the HTTP
  API) is taken to mean that the trainer pushed the weights into the engine itself: the
  version is adopted without loading anything.

The base model is the run's ``RunConfig.model`` when it names a local folder, and the tiny test
model (built under ``<data_dir>/models``) when the run names none.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path

from store.events import RunConfig
from store.settings import Settings
from workers.checkpoint_urls import CHECKPOINT_CACHE, download, is_url
from workers.engines.backend import GenerationBackend, WeightUpdatable
from workers.engines.identity import engine_id
from workers.engines.registry import make_backend
from workers.rollout.group_log import PolicyState

__all__ = ["RolloutEngine", "base_model_dir", "worker_engine"]

_lock = threading.Lock()
_engine: RolloutEngine | None = None


def base_model_dir(config: RunConfig, *, settings: Settings) -> Path:
    """The base model folder of a run (module docstring). Raises ValueError naming the run's
    ``model`` when it is not a local folder holding a ``config.json``."""
    if config.model is None:
        from workers.engines.tinymodel import tiny_model_path

        return tiny_model_path(settings.data_dir / "models")
    folder = Path(config.model).expanduser()
    if not (folder / "config.json").is_file():
        raise ValueError(f"run config field 'model': {config.model!r} is not a local model "
                         f"folder (no config.json); rollout workers load models from disk")
    return folder


class RolloutEngine:
    """One backend over one base model and the policy whose weights it holds.

    ``loaded`` is ``(run_id, version)`` of those weights (``None``: the base model's, as
    built); ``engine_id`` names the engine in ``policy_served`` reports (:func:`engine_id`).
    Raises TypeError when ``backend`` is not a generation backend.
    """

    def __init__(self, backend: GenerationBackend, *, kind: str, model_dir: Path,
                 cache_dir: Path | None = None) -> None:
        if not isinstance(backend, GenerationBackend):
            raise TypeError(f"backend must be a GenerationBackend, got {type(backend).__name__}")
        self.backend = backend
        self.kind = kind
        self.model_dir = Path(model_dir)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.loaded: tuple[str, int] | None = None
        self.loads = 0
        self.engine_id = engine_id(backend)
        self.reported: tuple[str, int] | None = None
        self.last_load: tuple[str | None, float] = (None, 0.0)

    def ensure(self, run_id: str, policy: PolicyState,
               report: Callable[..., None] | None = None) -> None:
        """Bring the weights to ``policy`` of ``run_id`` (module docstring), then, unless this
        take-up was reported already, call ``report(run_id, version=, engine=, backend=,
        source=, load_seconds=)`` (a ``GroupLog.policy_served``: the take-up is recorded;
        ``source`` is the folder loaded, None when nothing was). A report that fails is made
        again by the next call, without loading again. Raises FileNotFoundError
        when the checkpoint folder named has no ``model.safetensors`` or the checkpoint URL
        named holds no complete upload, ValueError for a URL whose protocol is unknown,
        TypeError when new weights are needed but the backend cannot take them, and what
        ``report`` raises."""
        target = (run_id, policy.version)
        if self.loaded != target:
            self._load(run_id, policy)
        if report is not None and self.reported != target:
            source, seconds = self.last_load
            report(run_id, version=policy.version, engine=self.engine_id,
                   backend=type(self.backend).__name__, source=source, load_seconds=seconds)
            self.reported = target

    def _load(self, run_id: str, policy: PolicyState) -> None:
        started = time.monotonic()
        if policy.version == 0:
            base_now = self.loaded is None or self.loaded[1] == 0
            source: Path | None = None if base_now else self.model_dir
        elif policy.checkpoint is None:
            source = None
        elif is_url(policy.checkpoint):
            source = download(policy.checkpoint, self._cache_dir())
        else:
            source = Path(policy.checkpoint)
        if source is not None:
            weights_file = source / "model.safetensors"
            if not weights_file.is_file():
                raise FileNotFoundError(f"policy version {policy.version} of run {run_id!r}: "
                                        f"no model.safetensors in {source}")
            if not isinstance(self.backend, WeightUpdatable):
                raise TypeError(f"{type(self.backend).__name__} cannot take new weights")
            from_folder = getattr(self.backend, "update_weights_from", None)
            if from_folder is not None:  # the engine reads the file itself
                from_folder(source, version=policy.version)
            else:
                from safetensors.torch import load_file

                self.backend.update_weights(load_file(str(weights_file)).items(),
                                            version=policy.version)
            self.loads += 1
        else:
            self.backend.policy_version = policy.version  # type: ignore[attr-defined]
        self.loaded = (run_id, policy.version)
        named = policy.checkpoint if source is not None and is_url(policy.checkpoint) else (
            str(source) if source is not None else None)
        self.last_load = (named, time.monotonic() - started)

    def _cache_dir(self) -> Path:
        """Where checkpoints named by URLs are downloaded: ``cache_dir``, else the settings'
        ``<data_dir>/checkpoint-cache``."""
        if self.cache_dir is None:
            self.cache_dir = Settings().data_dir / CHECKPOINT_CACHE
        return self.cache_dir


def worker_engine(config: RunConfig, *, settings: Settings) -> RolloutEngine:
    """This process's engine for a run with ``config``: the one kept from earlier tasks when
    it serves the same base model with the configured kind and is alive, else a new one (the
    old one is closed and dropped). Raises as :func:`base_model_dir` and :func:`make_backend`."""
    global _engine
    model_dir = base_model_dir(config, settings=settings)
    kind = settings.rollout_backend
    with _lock:
        dead = _engine is not None and getattr(_engine.backend, "dead", None)
        if dead or _engine is None or _engine.model_dir != model_dir or _engine.kind != kind:
            if _engine is not None:  # a dead engine is replaced, its resources freed
                with contextlib.suppress(Exception):
                    getattr(_engine.backend, "close", lambda: None)()
            _engine = None
            _engine = RolloutEngine(make_backend(kind, model_dir, settings=settings),
                                    kind=kind, model_dir=model_dir,
                                    cache_dir=settings.data_dir / CHECKPOINT_CACHE)
        return _engine
