"""Where each token of a token sequence starts in its decoded text.

Segmenting a prompt into messages needs, for every prompt token, the character at which its
text starts. Byte-level BPE tokenizers (GPT-2, Llama 3, Qwen) map every id to a fixed byte
string, so the offsets are a cumulative sum of the ids' byte lengths; the table is checked
against the tokenizer's own decoding of every sequence that holds an id no earlier check
covered, and is not used when the two disagree.
Every other tokenizer is decoded incrementally with ``tokenizers``' ``DecodeStream`` (linear,
slower). A token that ends inside a multi-byte character starts at that character.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from itertools import accumulate
from typing import Any

import numpy as np

from workers.replay.errors import ReplayError

__all__ = ["IdDecoder", "byte_level_alphabet", "decode_appendable", "decode_with_offsets"]


def byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet: the printable character that stands for each byte value
    (printable Latin-1 bytes stand for themselves, the others for code points from 256 on),
    as a map from character to byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


class _ByteTable:
    """Per-id byte strings of a byte-level tokenizer, and which ids a check against the
    tokenizer's own decoding has covered."""

    def __init__(self, backend: Any) -> None:
        alphabet = byte_level_alphabet()
        vocab = backend.get_vocab(with_added_tokens=True)
        size = max(vocab.values()) + 1 if vocab else 0
        pieces: list[bytes] = [b""] * size
        for token, idx in vocab.items():
            try:
                pieces[idx] = bytes(alphabet[c] for c in token)
            except KeyError:
                pieces[idx] = token.encode("utf-8")
        for idx, added in backend.get_added_tokens_decoder().items():
            if idx < size:
                pieces[idx] = added.content.encode("utf-8")
        self.pieces = pieces
        #: Ids that occurred in a sequence whose table decoding equalled the tokenizer's.
        self.checked: set[int] = set()


_TABLES: weakref.WeakKeyDictionary[Any, _ByteTable] = weakref.WeakKeyDictionary()
#: tokenizer -> (its ``tokenizers`` backend, the backend's byte table or None), found once
#: per tokenizer (reading ``backend.decoder`` builds a new wrapper object every time).
_DECODERS: weakref.WeakKeyDictionary[Any, tuple[Any, _ByteTable | None]] = \
    weakref.WeakKeyDictionary()


def _backend(tokenizer: Any) -> Any:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        backend = getattr(tokenizer, "_tokenizer", None)
    return backend


def _byte_table(backend: Any) -> _ByteTable | None:
    decoder = backend.decoder
    if decoder is None or type(decoder).__name__ != "ByteLevel":
        return None
    try:
        table = _TABLES.get(backend)
    except TypeError:
        table = None
    if table is None:
        table = _ByteTable(backend)
        try:
            _TABLES[backend] = table
        except TypeError:
            pass
    return table


def _decoder_of(tokenizer: Any) -> tuple[Any, _ByteTable | None]:
    """The backend of ``tokenizer`` and its byte table; TypeError when it has no fast
    (``tokenizers``) backend."""
    try:
        found = _DECODERS.get(tokenizer)
    except TypeError:  # a tokenizer that cannot be weakly referenced
        found = None
    if found is None:
        backend = _backend(tokenizer)
        if backend is None or not hasattr(backend, "decode"):
            raise TypeError(f"tokenizer must be a fast tokenizer with a `tokenizers` backend, "
                            f"got {type(tokenizer).__name__}")
        found = (backend, _byte_table(backend))
        try:
            _DECODERS[tokenizer] = found
        except TypeError:
            pass
    return found


def _char_starts_of_bytes(text: str, byte_starts: list[int]) -> list[int]:
    """Map byte offsets into ``text``'s UTF-8 encoding to character offsets."""
    if text.isascii():
        return byte_starts
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    widths = 1 + (codes >= 0x80) + (codes >= 0x800) + (codes >= 0x10000)
    char_byte_start = np.cumsum(widths) - widths
    starts = np.searchsorted(char_byte_start, np.asarray(byte_starts, dtype=np.int64),
                             side="right") - 1
    return starts.tolist()


def _by_table(backend: Any, table: _ByteTable, ids: list[int]) -> tuple[str, list[int]] | None:
    """The text and token starts from the byte table, or None when the table cannot be
    trusted for these ids: a strict UTF-8 decoding fails (a sequence ending inside a
    character), or ids no earlier check covered give a text other than the tokenizer's
    own decoding. A byte-level decoding is the concatenation of the ids' byte strings, so
    an id whose byte string a check confirmed stays confirmed in any sequence. Plain list
    operations: a call's new tokens are a few dozen, where numpy's per-call cost dominates."""
    parts = list(map(table.pieces.__getitem__, ids))
    try:
        text = b"".join(parts).decode("utf-8")
    except UnicodeDecodeError:
        return None
    if not table.checked.issuperset(ids):
        if text != backend.decode(ids, skip_special_tokens=False):
            return None
        table.checked.update(ids)
    byte_starts = list(accumulate(map(len, parts), initial=0))
    byte_starts.pop()
    return text, _char_starts_of_bytes(text, byte_starts)


def _by_stream(backend: Any, ids: list[int]) -> tuple[str, list[int]]:
    from tokenizers.decoders import DecodeStream

    stream = DecodeStream(skip_special_tokens=False)
    starts = [0] * len(ids)
    chunks: list[str] = []
    emitted = 0
    pending: list[int] = []
    for t, token in enumerate(ids):
        pending.append(t)
        chunk = stream.step(backend, token)
        if chunk is None:
            continue
        for p in pending:
            starts[p] = emitted
        pending.clear()
        chunks.append(chunk)
        emitted += len(chunk)
    for p in pending:
        starts[p] = emitted
    return "".join(chunks), starts


def decode_with_offsets(tokenizer: Any, token_ids: Sequence[int] | np.ndarray
                        ) -> tuple[str, np.ndarray]:
    """Decode ``token_ids`` with ``tokenizer`` (special tokens kept, no clean-up) and give
    each token's start character in the text: ``starts`` has shape ``(num_tokens,)`` and is
    non-decreasing. Raises TypeError when ``tokenizer`` has no fast (``tokenizers``) backend
    and ReplayError when an id lies outside the vocabulary or the incremental decoding does
    not reproduce the tokenizer's own."""
    text, starts, _ = decode_appendable(tokenizer, token_ids)
    return text, starts


def decode_appendable(tokenizer: Any, token_ids: Sequence[int] | np.ndarray
                      ) -> tuple[str, np.ndarray, bool]:
    """``decode_with_offsets`` plus whether the text is appendable: the strict UTF-8 decoding
    of the tokens' byte strings (a byte-level tokenizer, whole characters only). The decoding
    of two appendable id sequences one after the other is then the concatenation of their
    texts (a byte-level decoder joins byte strings and decodes them as UTF-8; both halves
    being whole characters, nothing straddles the join), with the second's offsets shifted
    by the first text's length. Raises as ``decode_with_offsets``."""
    decode = IdDecoder(tokenizer)
    decode.prepare()  # a tokenizer without a fast backend is refused before the ids
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise TypeError(f"token_ids must be a 1-d sequence of integers, got shape {ids.shape} "
                        f"dtype {ids.dtype}")
    text, starts, appendable = decode(ids.astype(np.int64, copy=False).tolist())
    return text, np.asarray(starts, dtype=np.int64), appendable


class IdDecoder:
    """``decode_appendable`` for lists of Python ints, with the starts as a list, with one
    tokenizer whose backend, byte table and vocabulary size are looked up once (a
    ``Segmenter`` decodes an episode's calls with one). Raises as ``decode_appendable``."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._found: tuple[Any, _ByteTable | None, int] | None = None

    def prepare(self) -> tuple[Any, _ByteTable | None, int]:
        """The backend, byte table and vocabulary size; TypeError when the tokenizer has no
        fast backend."""
        if self._found is None:
            backend, table = _decoder_of(self.tokenizer)
            self._found = (backend, table, backend.get_vocab_size(with_added_tokens=True))
        return self._found

    def __call__(self, ids: list[int]) -> tuple[str, list[int], bool]:
        return _decode(*self.prepare(), ids)


def _decode(backend: Any, table: _ByteTable | None, size: int, ids: list[int]
            ) -> tuple[str, list[int], bool]:
    if ids and (min(ids) < 0 or max(ids) >= size):
        p = next(p for p, i in enumerate(ids) if not 0 <= i < size)
        raise ReplayError(f"token id {ids[p]} at position {p} is outside the "
                          f"vocabulary of size {size}")
    if table is not None and len(table.pieces) >= size:
        found = _by_table(backend, table, ids)
        if found is not None:
            return found[0], found[1], True
    expected = backend.decode(ids, skip_special_tokens=False)
    text, starts = _by_stream(backend, ids)
    if text != expected:
        raise ReplayError("incremental decoding of the token ids does not reproduce the "
                          "tokenizer's decoding; cannot place tokens in the text")
    return text, starts, False
