"""Checkpoints on shared storage named by fsspec URLs (``s3://bucket/prefix``, ``file:///...``).

A trainer whose checkpoint root is a URL saves each checkpoint in a local folder first, then
uploads its files under ``<root>/<run>/v<version>`` and writes :data:`COMPLETE_MARKER` last;
``policy_updated`` names that URL. A reader only takes a checkpoint whose marker is there, so
it never sees a half-uploaded one. Readers (the rollout engine, a reopened trainer) download it
into a local cache folder keyed by the URL and load from there; a cached copy is complete (it
is moved into place only once every file has arrived) and is reused.

Anything that is not a URL (no ``<protocol>://``) is a local path and is left to the callers,
which treat it as before.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

__all__ = [
    "CHECKPOINT_CACHE",
    "COMPLETE_MARKER",
    "check_writable",
    "download",
    "is_complete",
    "is_url",
    "join",
    "prune",
    "remove",
    "upload",
]

#: The folder under the data directory where readers keep their downloaded copies.
CHECKPOINT_CACHE = "checkpoint-cache"
#: The file written last into an uploaded checkpoint: readers require it.
COMPLETE_MARKER = ".trajstore-complete"
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_VERSION_DIR = re.compile(r"^v(\d+)(?:-[a-z0-9]+)?$")


def is_url(location: str | os.PathLike[str] | None) -> bool:
    """True when ``location`` is a string of the form ``<protocol>://...``."""
    return isinstance(location, str) and bool(_URL.match(location))


def _filesystem(url: str) -> tuple[Any, str]:
    """fsspec's filesystem and path for ``url``; ValueError naming the URL when fsspec does
    not know its protocol (or cannot load the package it needs)."""
    import fsspec

    try:
        return fsspec.core.url_to_fs(url)
    except (ValueError, ImportError) as exc:
        raise ValueError(f"checkpoint URL {url!r} cannot be used: {exc}") from None


def join(root: str, *parts: str) -> str:
    """``root`` with ``parts`` appended, one ``/`` between each."""
    return "/".join([root.rstrip("/"), *(p.strip("/") for p in parts)])


def check_writable(url: str) -> None:
    """Refuse a checkpoint root that cannot be used: writes a small probe file under ``url``
    and deletes it. Raises ValueError naming the URL and the reason (unknown protocol, the
    storage refusing the write)."""
    fs, path = _filesystem(url)
    probe = f"{path.rstrip('/')}/.write-check-{uuid.uuid4().hex[:8]}"
    try:
        fs.makedirs(path, exist_ok=True)
        fs.pipe_file(probe, b"")
        fs.rm(probe)
    except Exception as exc:  # fsspec backends raise their own errors
        raise ValueError(f"checkpoint URL {url!r} cannot be written: "
                         f"{type(exc).__name__}: {exc}") from None


def upload(folder: str | os.PathLike[str], url: str) -> str:
    """Copy the files of the local checkpoint ``folder`` under ``url`` (replacing what a
    failed earlier upload left there), then write :data:`COMPLETE_MARKER`; returns ``url``.
    Raises ValueError for an unknown protocol and the storage's errors for a failed write (the
    marker is then absent, so no reader takes the partial copy)."""
    fs, path = _filesystem(url)
    path = path.rstrip("/")
    if fs.exists(path):
        fs.rm(path, recursive=True)
    fs.makedirs(path, exist_ok=True)
    source = Path(folder)
    for file in sorted(p for p in source.rglob("*") if p.is_file()):
        target = f"{path}/{file.relative_to(source).as_posix()}"
        fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        fs.put_file(str(file), target)
    fs.pipe_file(f"{path}/{COMPLETE_MARKER}", b"")
    return url


def is_complete(url: str) -> bool:
    """True when the checkpoint at ``url`` was uploaded completely (its marker is there);
    False also when the storage cannot be reached or the protocol is unknown."""
    try:
        fs, path = _filesystem(url)
        return bool(fs.exists(f"{path.rstrip('/')}/{COMPLETE_MARKER}"))
    except Exception:
        return False


def download(url: str, cache_dir: str | os.PathLike[str]) -> Path:
    """The local copy of the checkpoint at ``url`` in ``cache_dir`` (one folder per URL,
    reused when there); downloaded into a temporary sibling, then moved into place. Raises
    FileNotFoundError naming the URL when the checkpoint is not complete there, ValueError for
    an unknown protocol."""
    cache = Path(cache_dir)
    name = hashlib.sha256(url.encode()).hexdigest()[:24]
    target = cache / name
    if (target / COMPLETE_MARKER).is_file():
        return target
    if not is_complete(url):
        raise FileNotFoundError(f"checkpoint {url!r} is missing or incomplete (no "
                                f"{COMPLETE_MARKER})")
    fs, path = _filesystem(url)
    path = path.rstrip("/")
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=cache))
    try:
        for remote in fs.find(path):
            relative = remote[len(path):].lstrip("/")
            if not relative or relative == COMPLETE_MARKER:
                continue
            local = staging / relative
            local.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(remote, str(local))
        (staging / COMPLETE_MARKER).write_bytes(b"")
        if target.exists():  # a copy without its marker: a download that died midway
            shutil.rmtree(target)
        try:
            os.replace(staging, target)
        except OSError:
            if not (target / COMPLETE_MARKER).is_file():  # not another reader's copy
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def remove(url: str) -> None:
    """Delete the checkpoint at ``url`` (marker first, so no reader takes what is left);
    nothing when it is not there."""
    fs, path = _filesystem(url)
    path = path.rstrip("/")
    marker = f"{path}/{COMPLETE_MARKER}"
    if fs.exists(marker):
        fs.rm(marker)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def prune(run_url: str, *, keep: int) -> list[str]:
    """Delete all but the ``keep`` newest version folders (``v<N>[-<tag>]``) under
    ``run_url``; returns the deleted URLs. Raises ValueError for ``keep < 1``."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be a positive integer, got {keep!r}")
    fs, path = _filesystem(run_url)
    if not fs.exists(path):
        return []
    versions = []
    for entry in fs.ls(path, detail=True):
        name = str(entry["name"]).rstrip("/").rsplit("/", 1)[-1]
        if entry.get("type") == "directory" and (match := _VERSION_DIR.match(name)):
            versions.append((int(match.group(1)), name))
    doomed = [join(run_url, name) for _, name in sorted(versions)[:-keep]]
    for url in doomed:
        remove(url)
    return doomed
