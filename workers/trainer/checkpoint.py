"""Checkpoints: one folder per policy version, written atomically, loadable by any engine.

A checkpoint folder holds the model as Hugging Face saves it (``config.json``,
``generation_config.json``, ``model.safetensors``), the tokenizer files when given, the
optimizer state as ``optimizer.safetensors`` (tensors) plus its non-tensor part in
``trainer_state.json`` together with the trainer's own state (run, version, step). Nothing is
pickled. So transformers and vLLM load a checkpoint folder like any model folder, and a
restarted trainer resumes from it with its optimizer moments.

Folders live under ``<data_dir>/checkpoints/<run>/v<version>`` and are written to a temporary
sibling first, then renamed, so a reader never sees half a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from workers.engines.transformers_lock import LOCK

__all__ = [
    "OPTIMIZER_FILE",
    "STATE_FILE",
    "checkpoint_dir",
    "load_model",
    "load_optimizer_state",
    "prune_checkpoints",
    "read_state",
    "save_checkpoint",
]

STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.safetensors"
_VERSION_DIR = re.compile(r"^v(\d+)(?:-[a-z0-9]+)?$")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _run_folder_name(run_id: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", run_id)
    if safe == run_id and safe not in (".", ".."):
        return safe
    # Different run ids must not share a folder once their odd characters are replaced.
    return f"{safe}-{hashlib.sha256(run_id.encode()).hexdigest()[:12]}"


def checkpoint_dir(data_dir: str | os.PathLike[str], run_id: str, *, version: int,
                   tag: str | None = None) -> Path:
    """``<data_dir>/checkpoints/<run>/v<version, 6 digits>[-<tag>]``; characters of ``run_id``
    that are unsafe in a file name are replaced (and a hash of the id appended). Raises
    ValueError for an empty ``run_id``, a negative ``version`` or a ``tag`` that is not
    lowercase letters and digits."""
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"run_id must be a non-empty string, got {run_id!r}")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version must be a non-negative integer, got {version!r}")
    if tag is not None and not re.fullmatch(r"[a-z0-9]+", tag or ""):
        raise ValueError(f"tag must be lowercase letters and digits, got {tag!r}")
    name = f"v{version:06d}" + (f"-{tag}" if tag else "")
    return Path(data_dir) / "checkpoints" / _run_folder_name(run_id) / name


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor],
                                                                  dict[str, Any]]:
    """Split an optimizer state dict into flat tensors and a JSON-ready rest."""
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, values in state["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(index), {})[key] = value
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()}
              for group in state["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def save_checkpoint(
    directory: str | os.PathLike[str],
    *,
    model: Any,
    state: dict[str, Any],
    tokenizer: Any | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> Path:
    """Write a checkpoint folder at ``directory`` atomically (replacing one already there) and
    return its path. ``state`` is the trainer's JSON-ready state (run, version, step,
    metrics). Raises TypeError when ``model`` has no ``save_pretrained`` or ``state`` is not a
    JSON-serialisable dict."""
    if not callable(getattr(model, "save_pretrained", None)):
        raise TypeError(f"model must be a transformers model, got {type(model).__name__}")
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, got {type(state).__name__}")
    target = Path(directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        model.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        record: dict[str, Any] = {"trainer": state}
        if optimizer is not None:
            tensors, rest = _optimizer_tensors(optimizer)
            save_file(tensors, str(staging / OPTIMIZER_FILE))
            record["optimizer"] = rest
        (staging / STATE_FILE).write_text(json.dumps(record, indent=1, sort_keys=True))
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def read_state(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The trainer state saved in a checkpoint folder. Raises FileNotFoundError naming the
    folder when it holds no trainer state."""
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a trainer checkpoint (no {STATE_FILE})")
    state = json.loads(path.read_text())["trainer"]
    assert isinstance(state, dict)
    return state


def load_model(path: str | os.PathLike[str], *, device: str | torch.device = "cpu",
               dtype: str = "float32") -> Any:
    """Load a causal LM from a model or checkpoint folder onto ``device`` in ``dtype``
    ("float32", "bfloat16", "float16"), in eval mode (no dropout). Raises ValueError for a
    missing folder or an unknown dtype."""
    with LOCK:  # transformers' lazy names: one first use at a time
        from transformers import AutoModelForCausalLM

    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"model folder {str(folder)!r} does not exist")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    with LOCK:  # transformers' lazy names: one first use at a time
        model: Any = AutoModelForCausalLM.from_pretrained(str(folder), dtype=_DTYPES[dtype],
                                                          local_files_only=True)
    model.to(torch.device(device))
    model.eval()
    return model


def load_optimizer_state(directory: str | os.PathLike[str],
                         optimizer: torch.optim.Optimizer) -> bool:
    """Restore ``optimizer`` from a checkpoint folder; False (nothing changed) when the folder
    has no optimizer state. Raises ValueError when the saved state does not fit ``optimizer``
    (another model or parameter grouping)."""
    folder = Path(directory)
    tensors_path = folder / OPTIMIZER_FILE
    if not tensors_path.is_file():
        return False
    saved = json.loads((folder / STATE_FILE).read_text()).get("optimizer")
    if saved is None:
        return False
    tensors = load_file(str(tensors_path))
    state: dict[int, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = tensor
    for index, values in saved["scalars"].items():
        state.setdefault(int(index), {}).update(values)
    groups = saved["param_groups"]
    current = optimizer.state_dict()["param_groups"]
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in current]:
        raise ValueError(f"the optimizer state in {folder} has parameter groups of sizes "
                         f"{[len(g['params']) for g in groups]}, this optimizer "
                         f"{[len(g['params']) for g in current]}")
    for group in groups:
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    return True


def prune_checkpoints(run_folder: str | os.PathLike[str], *, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest version folders (``v<N>[-<tag>]``) in ``run_folder`` and
    return the deleted paths; other files are left alone. Raises ValueError for ``keep < 1``."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be a positive integer, got {keep!r}")
    folder = Path(run_folder)
    if not folder.is_dir():
        return []
    versions = sorted(
        (int(match.group(1)), child.name, child) for child in folder.iterdir()
        if child.is_dir() and (match := _VERSION_DIR.match(child.name)))
    doomed = [path for _, _, path in versions[:-keep]]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed
