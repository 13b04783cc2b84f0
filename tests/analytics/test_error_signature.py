"""Error signatures: the rules by example, bad input, and the SQL function of migration 0005
agreeing with the Python one on examples and on many generated messages."""

from __future__ import annotations

import random
from collections.abc import Iterator

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from store.error_signature import MAX_SIGNATURE_LENGTH, error_signature
from tests.analytics.conftest import Seeded

EXAMPLES = {
    "TypeError: unexpected argument 'q' at /srv/tools/search.py:42":
        "TypeError: unexpected argument '<str>' at <path>:<n>",
    'File "/tmp/tmpab12/main.py", line 3, in <module>':
        'File "<str>", line <n>, in <module>',
    "KeyError: `user_id` missing in row 123e4567-e89b-12d3-a456-426614174000":
        "KeyError: `<str>` missing in row <uuid>",
    "segfault at 0x7ffd1a2b, object a3f9c2e1d0 freed":
        "segfault at <hex>, object <hex> freed",
    "ModuleNotFoundError: No module named 'numpyy'":
        "ModuleNotFoundError: No module named '<str>'",
    "ratio 3.5e-3 below 1.25 at turn_1 (python3)":
        "ratio <n> below <n> at turn_1 (python3)",
    r"cannot open C:\Users\bob\data.csv or ~/data.csv or ../data.csv":
        "cannot open <path> or <path> or <path>",
    "  many\t\tspaces\n\nand lines  ": "many spaces and lines",
    "can't parse {\"a\": 12}": "can't parse {\"<str>\": <n>}",
    "deadbeef is a word, 12345678 a number": "deadbeef is a word, <n> a number",
    "": "",
}


@pytest.mark.parametrize(("message", "signature"), EXAMPLES.items())
def test_examples(message: str, signature: str) -> None:
    assert error_signature(message) == signature


def test_same_failure_other_details_same_signature() -> None:
    a = error_signature("IndexError: index 7 is out of range for list of length 3 (/a/b.py)")
    b = error_signature("IndexError: index 12 is out of range for list of length 10 (/c.py)")
    assert a == b
    assert error_signature("IndexError: x") != error_signature("KeyError: x")


def test_none_long_and_bad_input() -> None:
    assert error_signature(None) is None
    assert len(error_signature("x" * 5000) or "") == MAX_SIGNATURE_LENGTH
    with pytest.raises(TypeError, match="message must be a str or None, got bytes"):
        error_signature(b"oops")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="NUL"):
        error_signature("a\x00b")


@pytest.fixture(scope="module")
def conn(seeded: Seeded) -> Iterator[psycopg.Connection]:
    with psycopg.connect(seeded.url, autocommit=True) as c:
        yield c


def sql_signatures(conn: psycopg.Connection, messages: list[str | None]) -> list[str | None]:
    rows = conn.execute(
        "SELECT trajstore_error_signature(m) FROM unnest(%s::text[]) WITH ORDINALITY AS u(m, i)"
        " ORDER BY i", (messages,)).fetchall()
    return [r[0] for r in rows]


def test_sql_agrees_on_the_examples(conn: psycopg.Connection) -> None:
    messages: list[str | None] = [*EXAMPLES, None, "x" * 5000]
    assert sql_signatures(conn, messages) == [error_signature(m) for m in messages]


# Characters every rule turns on, so that random messages hit their edges often.
ALPHABET = "aAfFxXzZ09_5.-+eE'\"`/\\~: \t\n()<>é中"


def random_message(rng: random.Random) -> str:
    pieces = [
        lambda: "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 12))),
        lambda: str(rng.randint(0, 10**9)),
        lambda: f"{rng.random() * 10 ** rng.randint(-5, 5):g}",
        lambda: "".join(rng.choice("0123456789abcdefABCDEF") for _ in range(rng.randint(6, 14))),
        lambda: "-".join("".join(rng.choice("0123456789abcdef") for _ in range(n))
                         for n in (8, 4, 4, 4, 12)),
        lambda: rng.choice(["/", "./", "../", "~/", "C:\\", ""]) + "/".join(
            rng.choice(["usr", "lib", "x.py", "a-b", "v1.2"]) for _ in range(rng.randint(1, 3))),
        lambda: rng.choice("'\"`") + rng.choice(["name", "", "it's", "a b"]) + rng.choice("'\"`"),
        lambda: rng.choice(["Error: ", "line ", " at ", "0x", "turn_", "e", "\n"]),
    ]
    return "".join(rng.choice(pieces)() for _ in range(rng.randint(0, 10)))


def test_sql_agrees_on_seeded_random_messages(conn: psycopg.Connection) -> None:
    rng = random.Random(20261122)
    messages: list[str | None] = [random_message(rng) for _ in range(3000)]
    got = sql_signatures(conn, messages)
    mismatches = [(m, g, error_signature(m)) for m, g in zip(messages, got, strict=True)
                  if g != error_signature(m)]
    assert mismatches == []


@settings(max_examples=200, deadline=None)
@given(message=st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x00"),
                       max_size=80))
def test_sql_agrees_on_any_text(conn: psycopg.Connection, message: str) -> None:
    assert sql_signatures(conn, [message]) == [error_signature(message)]
