"""How a command opens the store: one place for the error it prints when it cannot."""

from __future__ import annotations

from typing import Any

import typer

from store import errors
from store.settings import Settings, get_settings

__all__ = ["open_store"]


def open_store(settings: Settings | None = None) -> Any:
    """The ``EventStore`` the settings name. A setting that cannot be used (an unreachable
    database, say) propagates as ``ConfigurationError``, which the command line prints as
    one line with exit status 2; any other store error (a schema that is not migrated) is
    printed here as one line and ends the command with status 1."""
    from store.eventlog import EventStore

    try:
        return EventStore.open(settings or get_settings())
    except errors.ConfigurationError:
        raise
    except errors.StoreError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
