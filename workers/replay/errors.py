"""Why an episode cannot be replayed.

A ``ReplayError`` means the episode's events do not describe a replayable episode (prompt ids
that are not a rendering of the request messages, an attempt naming an unknown call, …); the
replay worker records such episodes as ``invalid`` with the ``reason``. It subclasses
ValueError: it is bad input, named.
"""

from __future__ import annotations

__all__ = ["PromptMismatchError", "ReplayError", "SegmentationError"]


class ReplayError(ValueError):
    """The episode cannot be replayed; ``reason`` says why, ``call_id`` names the LLM call
    concerned when there is one."""

    def __init__(self, reason: str, *, call_id: str | None = None) -> None:
        self.reason = reason
        self.call_id = call_id
        super().__init__(reason if call_id is None else f"llm call {call_id!r}: {reason}")


class PromptMismatchError(ReplayError):
    """The prompt ids do not decode to the chat template's rendering of the messages."""


class SegmentationError(ReplayError):
    """The rendering could not be cut into messages (the template renders a message in a way
    that cannot be located in the prompt); ``message_index`` names the message."""

    def __init__(self, reason: str, *, message_index: int, call_id: str | None = None) -> None:
        self.message_index = message_index
        super().__init__(reason, call_id=call_id)
