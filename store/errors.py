"""The store's small error tree. Driver errors are translated into it in ``store.db`` only.

``TransientError`` is the one kind worth retrying; everything else is the caller's to fix.
"""

from __future__ import annotations

__all__ = [
    "StoreError",
    "ValidationError",
    "ClosedError",
    "ConflictError",
    "SamplesTakenError",
    "IdempotencyError",
    "NotFoundError",
    "TransientError",
    "DuplicateKeyError",
    "RefusedError",
    "ConfigurationError",
]


class StoreError(Exception):
    """Base of every error the store raises on purpose."""


class ValidationError(StoreError, ValueError):
    """An event or argument is invalid. ``event_index`` and ``field`` name what is wrong."""

    def __init__(self, message: str, *, event_index: int | None = None, field: str | None = None,
                 from_database: bool = False):
        self.event_index = event_index
        self.field = field
        self.reason = message
        # The database refused a value (``store.db.translate_errors``): it does not say
        # which, so ``field`` is None unless the caller knew it.
        self.from_database = from_database
        where = []
        if event_index is not None:
            where.append(f"event {event_index}")
        if field:
            where.append(f"field {field!r}")
        super().__init__(f"{', '.join(where)}: {message}" if where else message)


class ConflictError(StoreError):
    """The stream is not at the version the append expected. Nothing was stored."""

    def __init__(self, stream_id: str, *, expected: object, actual: int):
        self.stream_id = stream_id
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"stream {stream_id!r} is at version {actual}, the append expected {expected}"
        )


class ClosedError(ConflictError):
    """The episode is finished: no event but a late ``reward_assigned`` may follow its
    ``episode_finished``. Nothing was stored. (A ``ConflictError``: code that retries on a
    stale version stops here too.)"""

    def __init__(self, stream_id: str, *, actual: int):
        StoreError.__init__(
            self, f"episode {stream_id!r} is finished (version {actual}); no event may follow "
            "its episode_finished but a late reward_assigned")
        self.stream_id = stream_id
        self.expected = "an open episode"
        self.actual = actual


class SamplesTakenError(ConflictError):
    """A late reward for a finished episode some of whose samples a trainer took: consumed
    (acknowledged after an optimizer step: trained with the reward they had) or leased under
    a lease that has not ended (a trainer holds them and expects them not to change).
    ``samples`` names them (``sample_id``, ``kind``, ``timeline_index``, ``status``);
    ``consumed`` is True when any is consumed (final), False when they are only leased (a
    reward sent after the lease is released or expires is taken). Nothing was stored."""

    def __init__(self, stream_id: str, *, actual: int, samples: list[dict[str, object]]):
        self.samples = samples
        self.consumed = any(s["status"] == "consumed" for s in samples)
        named = ", ".join(f"{s['sample_id']} ({s['kind']} {s['timeline_index']}, "
                          f"{s['status']})" for s in samples)
        what = ("were trained with the reward they had" if self.consumed
                else "are leased to a trainer; send the reward again once the lease ends")
        StoreError.__init__(
            self, f"episode {stream_id!r} is finished and its samples {named} {what}: the "
                  "reward is refused")
        self.stream_id = stream_id
        self.expected = "no consumed or leased sample"
        self.actual = actual


class IdempotencyError(StoreError):
    """An event id was appended before with different content, or to another stream.
    Nothing was stored. ``position`` is the stored event's log position when it lies in the
    stream appended to (the caller's own event), None when it lies in another stream: an id
    another stream holds (perhaps another project's) is answered without anything about it."""

    def __init__(self, event_id: object, *, position: int | None):
        self.event_id = event_id
        self.position = position
        if position is None:
            message = (f"event id {event_id} is taken by an event of another stream; "
                       "give each new event a fresh id (a retry sends the same events to "
                       "the same stream)")
        else:
            message = (f"event id {event_id} is already stored at position {position} "
                       "with different content")
        super().__init__(message)


class NotFoundError(StoreError, LookupError):
    """A stream, run or episode does not exist."""


class TransientError(StoreError):
    """The database is unreachable or the transaction was aborted by the server; retry."""


class DuplicateKeyError(StoreError):
    """A unique constraint refused a row; ``constraint`` names it. The event log turns this
    into a ``ConflictError`` or ``IdempotencyError``; other callers report it as is."""

    def __init__(self, constraint: str | None, message: str):
        self.constraint = constraint
        super().__init__(message)


class RefusedError(StoreError, PermissionError):
    """The database refused the statement (for example an UPDATE of an immutable event)."""


class ConfigurationError(StoreError):
    """A setting cannot be used as given: ``setting`` names it as it is spelled (an
    environment variable, or a command-line option), ``problem`` says what is wrong. The
    command line prints it as one line and exits with status 2."""

    def __init__(self, setting: str, problem: str):
        self.setting = setting
        self.problem = problem
        super().__init__(f"{setting}: {problem}")
