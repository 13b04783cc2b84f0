"""Decoding OTLP exports out of the API process, a bounded number per project at a time.

Decompressing and parsing an export (``api.otlp.decode``) is CPU work that holds the
interpreter lock for its whole length (the JSON parser and protobuf do not release it): a
flood of large exports from one project, decoded in the API process, would hold up every
other request of that process, whatever its project. So exports are decoded in a pool of
``OTLP_DECODE_PROCESSES`` child processes (0: in the API process's threads), and each
project has at most ``OTLP_MAX_CONCURRENT`` exports being decoded or stored in one API
process; one more is answered 429 (retryable, as OTLP exporters do) naming the setting. A
project flooding exports then holds at most that many child processes, and another
project's export finds one free (with the defaults, 4 processes and 2 exports per project:
a project flooding leaves two processes to the others).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from starlette.concurrency import run_in_threadpool

from api.errors import ApiError
from api.otlp.decode import OtlpLimits, Span, decode_request, decompress
from api.places import ProjectPlaces

__all__ = ["Admission", "decode_export"]

_lock = threading.Lock()
_pools: dict[int, ProcessPoolExecutor] = {}


def _decode(body: bytes, encoding: str | None, kind: str, limits: OtlpLimits,
            max_bytes: int) -> list[Span]:
    return decode_request(decompress(body, encoding, max_bytes=max_bytes), kind, limits)


def _pool(processes: int) -> ProcessPoolExecutor:
    with _lock:
        pool = _pools.get(processes)
        if pool is None:
            # Spawned, not forked: the API process runs threads (and a database pool).
            pool = _pools[processes] = ProcessPoolExecutor(
                processes, mp_context=multiprocessing.get_context("spawn"))
        return pool


def _drop(processes: int, pool: ProcessPoolExecutor) -> None:
    with _lock:
        if _pools.get(processes) is pool:
            del _pools[processes]
    pool.shutdown(wait=False, cancel_futures=True)


async def decode_export(body: bytes, encoding: str | None, kind: str, limits: OtlpLimits,
                        *, max_bytes: int, processes: int) -> list[Span]:
    """The spans of an export as sent (``body`` with Content-Encoding ``encoding``),
    decompressed and decoded in the pool of ``processes`` children (in a thread when 0).
    Raises what ``decompress`` and ``decode_request`` raise (OtlpError 400/413/415);
    ApiError 503 when a child died (the pool is started again for the next export)."""
    if processes <= 0:
        return await run_in_threadpool(_decode, body, encoding, kind, limits, max_bytes)
    pool = _pool(processes)
    try:
        return await asyncio.wrap_future(
            pool.submit(_decode, body, encoding, kind, limits, max_bytes))
    except BrokenProcessPool:
        _drop(processes, pool)
        raise ApiError(503, "unavailable", "the process decoding OTLP exports stopped; "
                       "retry the export", headers={"Retry-After": "1"}) from None


class Admission(ProjectPlaces):
    """How many exports of each project one API process is handling (module docstring)."""

    def __init__(self) -> None:
        super().__init__("OTLP export(s)", "TRAJSTORE_OTLP_MAX_CONCURRENT")
