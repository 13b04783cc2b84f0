"""The rule a chat conversation given as input obeys (a task's prompt, a remote rollout's
messages): a non-empty list of objects whose ``role`` is system, user, assistant or tool, and
whose ``content`` is a string (required for system, user and tool messages, optional for an
assistant message that only calls tools). One rule, so a task file and a remote rollout
refuse the same conversations with the same words."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["ROLES", "MessageFormatError", "check_messages"]

ROLES = ("system", "user", "assistant", "tool")


class MessageFormatError(ValueError):
    """A conversation breaks the rule above; the message names ``where`` and the field."""


def _fail(where: str, field: str, problem: str) -> MessageFormatError:
    return MessageFormatError(f"{where}: field {field!r}: {problem}")


def check_messages(value: Any, *, where: str) -> tuple[dict[str, Any], ...]:
    """``value`` as a tuple of message dicts (copies), or MessageFormatError naming ``where``
    and the faulty field (``messages``, ``messages[2].role``, …)."""
    if not isinstance(value, list) or not value:
        raise _fail(where, "messages", f"expected a non-empty list of messages, got {value!r}")
    messages = []
    for index, message in enumerate(value):
        field = f"messages[{index}]"
        if not isinstance(message, Mapping):
            raise _fail(where, field, f"expected an object, got {message!r}")
        if message.get("role") not in ROLES:
            raise _fail(where, f"{field}.role",
                        f"expected one of {list(ROLES)}, got {message.get('role')!r}")
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            raise _fail(where, f"{field}.content", f"expected a string, got {content!r}")
        if content is None and message["role"] in ("system", "user", "tool"):
            raise _fail(where, f"{field}.content", "is required for this role")
        messages.append(dict(message))
    return tuple(messages)
