"""Sending replay tasks when episodes finish, after the append has committed."""

from __future__ import annotations

import logging

from store.eventlog import AppendResult, EventStore
from store.events import EpisodeFinished, Event

__all__ = ["install_replay_dispatch"]

log = logging.getLogger(__name__)


def install_replay_dispatch(store: EventStore) -> None:
    """Make ``store`` send ``replay_episode`` for every stream whose append carried an
    ``episode_finished``. A send that fails (broker down) is logged and dropped: the periodic
    sweep projects the episode later, so the append never fails because of the broker."""

    def send(stream_id: str, events: list[Event], result: AppendResult) -> None:
        if any(isinstance(e, EpisodeFinished) for e in events):
            from workers.app import ensure_configured

            try:
                ensure_configured().send_task(
                    "trajstore.replay_episode", args=[stream_id], queue="replay"
                )
            except Exception as exc:  # the broker is down: the sweep will catch up
                log.warning("could not enqueue replay of %s (%s); the sweep will", stream_id,
                            exc)

    store.add_listener(send)
