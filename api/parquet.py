"""Writing Parquet as a stream of byte chunks: one row group per record batch, each row
group's bytes handed out as soon as it is written, so a large export never sits in memory
whole (only the footer, a few bytes per row group, is kept until the end)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["PARQUET_MEDIA_TYPE", "parquet_bytes", "stream_parquet"]

PARQUET_MEDIA_TYPE = "application/vnd.apache.parquet"


class _Chunks:
    """A write-only file object that keeps what was written until it is taken."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self.closed = False

    def write(self, data: bytes | memoryview) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def take(self) -> bytes:
        out = b"".join(self._parts)
        self._parts.clear()
        return out


def stream_parquet(batches: Iterable[pa.RecordBatch], schema: pa.Schema, *,
                   compression: str = "zstd") -> Iterator[bytes]:
    """Yield the bytes of a Parquet file holding ``batches`` (each one row group) as they
    are written. A batch whose schema differs from ``schema`` raises ValueError."""
    sink = _Chunks()
    writer = pq.ParquetWriter(pa.PythonFile(sink, mode="w"), schema, compression=compression)
    try:
        for batch in batches:
            if not batch.schema.equals(schema):
                raise ValueError(f"batch schema {batch.schema} differs from {schema}")
            writer.write_batch(batch)
            chunk = sink.take()
            if chunk:
                yield chunk
    finally:
        writer.close()
    tail = sink.take()
    if tail:
        yield tail


def parquet_bytes(batches: Iterable[pa.RecordBatch], schema: pa.Schema) -> bytes:
    """A whole Parquet file of ``batches`` in memory (for small answers such as a lease)."""
    return b"".join(stream_parquet(batches, schema))
