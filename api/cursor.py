"""Opaque page cursors: the last key of a page, base64url-encoded."""

from __future__ import annotations

import base64
import binascii

from api.errors import ApiError

__all__ = ["decode_cursor", "encode_cursor"]

_PREFIX = "k:"


def encode_cursor(last_key: int) -> str:
    """The cursor of a page that ended at ``last_key``."""
    return base64.urlsafe_b64encode(f"{_PREFIX}{int(last_key)}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str | None) -> int:
    """The key after which the next page starts (0 for no cursor). Raises ApiError 422
    naming the ``cursor`` parameter when it is not one this API handed out."""
    if not cursor:
        return 0
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        if not text.startswith(_PREFIX):
            raise ValueError(text)
        value = int(text[len(_PREFIX):])
        if value < 0 or value > 2**63 - 1:
            raise ValueError(text)
        return value
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise ApiError(422, "invalid_request", f"cursor {cursor[:40]!r} is not a cursor this "
                       "API handed out", field="query.cursor") from None
