"""Training metrics trackers: a small interface and the trackers that implement it.

A tracker receives one mapping of metric name to number per training step. ``jsonl`` (the
default) appends one JSON line per step to a file; ``tensorboard`` writes scalars through
``torch.utils.tensorboard`` (needs the ``tensorboard`` package); ``wandb`` logs to Weights &
Biases when that package is installed. ``make_trackers("jsonl,tensorboard", directory)``
builds several from a comma-separated list such as the ``TRAJSTORE_TRACKERS`` setting.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

__all__ = ["Tracker", "JsonlTracker", "TensorBoardTracker", "WandbTracker", "make_trackers"]


class Tracker(Protocol):
    """Anything with ``log(metrics, step)`` and ``close()`` can receive training metrics."""

    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def _numbers(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Keep the finite numbers; a tracker never fails a training step over a metric."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            out[str(key)] = float(value)
    return out


class JsonlTracker:
    """Appends ``{"step": n, **metrics}`` as one line to ``path`` per step."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self._file.write(json.dumps({"step": step, **_numbers(metrics)}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardTracker:
    """Scalars into a TensorBoard event directory; raises ImportError without tensorboard."""

    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(directory))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in _numbers(metrics).items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """Weights & Biases run; raises ImportError without the wandb package."""

    def __init__(self, directory: Path, project: str = "trajstore") -> None:
        import wandb

        self._run = wandb.init(project=project, dir=str(directory))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self._run.log(_numbers(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


def make_trackers(names: str, directory: Path) -> list[Tracker]:
    """Trackers for a comma-separated list of ``jsonl``, ``tensorboard``, ``wandb``.

    An unknown name raises ValueError naming it; a tracker whose package is missing raises
    ImportError naming the package to install."""
    trackers: list[Tracker] = []
    for name in (n.strip() for n in names.split(",") if n.strip()):
        if name == "jsonl":
            trackers.append(JsonlTracker(directory / "metrics.jsonl"))
        elif name in ("tensorboard", "wandb"):
            try:
                trackers.append(
                    TensorBoardTracker(directory / "tensorboard")
                    if name == "tensorboard"
                    else WandbTracker(directory)
                )
            except ImportError as exc:
                raise ImportError(f"tracker {name!r} needs `pip install {name}`") from exc
        else:
            raise ValueError(f"unknown tracker {name!r}; known: jsonl, tensorboard, wandb")
    return trackers
