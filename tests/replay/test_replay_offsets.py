"""Token start offsets: the byte-table path and the streaming path against plain loops."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest

from workers.replay.errors import ReplayError
from workers.replay.offsets import byte_level_alphabet, decode_with_offsets
from workers.replay.segment import common_prefix_length

_PIECES = list("ab xyz\n\t.,{}\"'") + ["🚀", "é", "ü", "—", "中文", "<|im_end|>", "<|eot_id|>",
                                         "<s>", "  ", "\n\n", "<think>"]


def _texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(_PIECES) for _ in range(rng.randint(0, 30)))
            for _ in range(count)]


def _prefix_decoding_reference(tokenizer, ids: list[int]) -> list[int]:
    """A token starts where the decoding of the tokens before it stops agreeing with the
    full decoding (an unfinished character decodes to a replacement mark, which disagrees)."""
    backend = tokenizer.backend_tokenizer
    full = backend.decode(ids, skip_special_tokens=False)
    return [common_prefix_length(backend.decode(ids[:i], skip_special_tokens=False), full)
            for i in range(len(ids))]


@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_byte_level_offsets_match_prefix_decoding(name: str, request) -> None:
    tokenizer = request.getfixturevalue(name)
    for text in _texts(3, 60):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        decoded, starts = decode_with_offsets(tokenizer, ids)
        assert decoded == text
        assert starts.tolist() == _prefix_decoding_reference(tokenizer, ids)


def _metaspace_reference(tokenizer, ids: list[int]) -> list[int]:
    """Byte string of each piece (byte-fallback pieces are their byte, the word marker a
    space, the very first space stripped), then each token starts at the character holding
    its first byte."""
    pieces = []
    for token in tokenizer.convert_ids_to_tokens(ids):
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            pieces.append(bytes([int(token[3:5], 16)]))
        else:
            pieces.append(token.replace("\u2581", " ").encode())
    if pieces and pieces[0].startswith(b" "):
        pieces[0] = pieces[0][1:]
    text = b"".join(pieces).decode()
    char_of_byte = []
    for index, ch in enumerate(text):
        char_of_byte.extend([index] * len(ch.encode()))
    starts, at = [], 0
    for p in pieces:
        starts.append(char_of_byte[at] if at < len(char_of_byte) else len(text))
        at += len(p)
    return starts


def test_streaming_offsets_match_piece_reference(metaspace) -> None:
    assert type(metaspace.backend_tokenizer.decoder).__name__ != "ByteLevel"
    for text in _texts(5, 60):
        text = text.replace("<|im_end|>", "").replace("<|eot_id|>", "").lstrip(" ")
        ids = metaspace(text, add_special_tokens=False)["input_ids"]
        decoded, starts = decode_with_offsets(metaspace, ids)
        assert decoded == metaspace.backend_tokenizer.decode(ids, skip_special_tokens=False)
        assert starts.tolist() == _metaspace_reference(metaspace, ids)


def test_alphabet_covers_every_byte_once() -> None:
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert alphabet["\u0120"] == ord(" ")  # the familiar 'Ġ'


def test_empty_and_bad_ids(qwen3) -> None:
    text, starts = decode_with_offsets(qwen3, [])
    assert text == "" and starts.shape == (0,)
    with pytest.raises(ReplayError, match="token id 999999 at position 1 is outside"):
        decode_with_offsets(qwen3, [1, 999999])
    with pytest.raises(TypeError, match="1-d sequence of integers"):
        decode_with_offsets(qwen3, np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(TypeError, match="fast tokenizer"):
        decode_with_offsets(object(), [1])


def test_byte_table_is_checked_for_ids_no_check_covered(qwen3) -> None:
    """An id whose table entry is wrong is caught the first time a sequence holds it (the
    text then comes from the streaming path), however many sequences were decoded before."""
    from workers.replay import offsets

    tokenizer = copy.deepcopy(qwen3)  # a table of its own, so the shared one stays right
    first = tokenizer("hello world", add_special_tokens=False)["input_ids"]
    text, _ = decode_with_offsets(tokenizer, first)
    assert text == "hello world"
    table = offsets._TABLES[tokenizer.backend_tokenizer]
    assert table.checked.issuperset(first)
    victim = tokenizer(" zebra", add_special_tokens=False)["input_ids"][-1]
    assert victim not in table.checked
    table.pieces[victim] = b" giraffe"
    ids = [*first, victim]
    text, starts = decode_with_offsets(tokenizer, ids)
    assert text == tokenizer.backend_tokenizer.decode(ids, skip_special_tokens=False)
    assert "giraffe" not in text and victim not in table.checked
    assert starts.tolist() == _prefix_decoding_reference(tokenizer, ids)


def test_common_prefix_length_matches_a_plain_loop() -> None:
    """Whatever ``likely`` guesses (nothing, too little, exactly, too much, past the end)."""
    rng = random.Random(11)
    for _ in range(1500):
        shared = "".join(rng.choice("ab<>\n") for _ in range(rng.randint(0, 300)))
        a = shared + "".join(rng.choice("abc") for _ in range(rng.randint(0, 80)))
        b = shared[:rng.randint(0, len(shared))] + "".join(rng.choice("abd")
                                                            for _ in range(rng.randint(0, 80)))
        a_start, b_start = rng.randint(0, 3), rng.randint(0, 3)
        if rng.random() < 0.5:
            b_start = a_start
        expected = 0
        while (a_start + expected < len(a) and b_start + expected < len(b)
               and a[a_start + expected] == b[b_start + expected]):
            expected += 1
        for likely in (0, rng.randint(1, 400), expected, expected + 1, len(a) + 5):
            assert common_prefix_length(a, b, a_start=a_start, b_start=b_start,
                                        likely=likely) == expected
