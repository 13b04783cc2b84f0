"""The watchdog of ``trajstore up``: whatever kills ``up``, what it started stops.

``up`` starts this as ``python -m trajstore.watchdog`` in a session of its own, with a pipe
as standard input, and writes a line to it for each thing it starts:

- ``child <pid> <create_time>``: a supervised child (it leads its own process group);
- ``redis``: ``up`` started the data directory's embedded Redis;
- ``done``: ``up`` stopped everything itself; nothing is left to do.

When the pipe closes without ``done`` (``up`` died: SIGKILL, a crash, the OOM killer), the
watchdog stops each child with its process group (SIGTERM, then SIGKILL after a grace), the
embedded Redis if ``up`` started it, and the embedded PostgreSQL if no living process still
uses it, printing a line for each on standard error. Its own session keeps it out of a
signal sent to ``up``'s process group.
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main() -> int:
    from store import embedded
    from store.settings import get_settings
    from trajstore.processes import stop_tree

    children: list[tuple[int, float]] = []
    redis_started = False
    for line in sys.stdin:
        word, *rest = line.split()
        if word == "done":
            return 0
        if word == "child":
            children.append((int(rest[0]), float(rest[1])))
        elif word == "redis":
            redis_started = True
    # The pipe closed without "done": up is gone.
    settings = get_settings()
    for pid, created in children:
        if stop_tree(pid, created, grace_s=20.0):
            print(f"trajstore up is gone: stopped its child (pid {pid})", file=sys.stderr)
    if redis_started and settings.redis_url is None:
        if (what := embedded.stop_embedded_redis(settings)) is not None:
            print(f"trajstore up is gone: stopped {what}", file=sys.stderr)
    if settings.database_url is None:
        what = embedded.stop_embedded_postgres(settings, only_if_unused=True)
        if what is not None:
            print(f"trajstore up is gone: stopped {what}", file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover - run by trajstore up
    sys.exit(main())
