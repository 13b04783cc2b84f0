"""Error signatures: an error message with its variable parts replaced, so that the same
failure groups together whatever numbers, paths, names or ids it carried.

The database computes the same signature (``trajstore_error_signature`` of migration 0005,
stored in ``failures.error_signature``); the rules here mirror it pattern for pattern and the
tests check that both agree. In order:

1. UUIDs become ``<uuid>``;
2. hexadecimal ids (``0x1f``, or 8+ hex digits mixing digits and letters) become ``<hex>``;
3. paths (``/a/b``, ``./a``, ``../a``, ``~/a``, ``C:\\a``) become ``<path>``;
4. text quoted with ``'``, ``"`` or a backtick becomes ``'<str>'``, ``"<str>"``, `` `<str>` ``;
5. numbers (``42``, ``3.14``, ``1e-5``; not digits inside a word such as ``turn_1``) become
   ``<n>``;
6. runs of whitespace become one space, the ends are trimmed, and the result is cut at
   1000 characters.

For example ``TypeError: unexpected argument 'q' at /srv/tools/search.py:42`` and
``TypeError: unexpected argument 'query2' at /srv/tools/search.py:17`` both have the
signature ``TypeError: unexpected argument '<str>' at <path>:<n>``.
"""

from __future__ import annotations

import re

__all__ = ["MAX_SIGNATURE_LENGTH", "error_signature"]

#: Longest signature kept (characters).
MAX_SIGNATURE_LENGTH = 1000

_NOT_AFTER_WORD = r"(?<![0-9A-Za-z_])"

#: (pattern, replacement) in the order they apply; the same texts as the SQL function's.
_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), replacement)
    for pattern, replacement in (
        (_NOT_AFTER_WORD + r"[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}"
         r"-[0-9A-Fa-f]{12}(?![0-9A-Za-z_])", "<uuid>"),
        (_NOT_AFTER_WORD + r"0[xX][0-9A-Fa-f]+(?![0-9A-Za-z_])", "<hex>"),
        (_NOT_AFTER_WORD + r"(?=[0-9A-Fa-f]*[A-Fa-f])(?=[0-9A-Fa-f]*[0-9])[0-9A-Fa-f]{8,}"
         r"(?![0-9A-Za-z_])", "<hex>"),
        (_NOT_AFTER_WORD + r"([A-Za-z]:|[.]{1,2}|~)?([/\\][0-9A-Za-z_.@+-]+)+", "<path>"),
        (_NOT_AFTER_WORD + r"'[^'\n]*'", "'<str>'"),
        (_NOT_AFTER_WORD + r'"[^"\n]*"', '"<str>"'),
        (_NOT_AFTER_WORD + r"`[^`\n]*`", "`<str>`"),
        (_NOT_AFTER_WORD + r"[0-9]+([.][0-9]+)?([eE][-+]?[0-9]+)?", "<n>"),
        (r"[ \t\n\r\f\v]+", " "),
    )
)


def error_signature(message: str | None) -> str | None:
    """The signature of ``message`` (see the module docstring); None for None.

    Raises TypeError naming the type when ``message`` is neither a string nor None, and
    ValueError when it contains a NUL character (which PostgreSQL text cannot hold, so the
    database could never have stored it).
    """
    if message is None:
        return None
    if not isinstance(message, str):
        raise TypeError(f"message must be a str or None, got {type(message).__name__}")
    if "\x00" in message:
        raise ValueError("message must not contain NUL characters")
    text = message
    for pattern, replacement in _RULES:
        text = pattern.sub(replacement, text)
    return text.strip(" ")[:MAX_SIGNATURE_LENGTH]
