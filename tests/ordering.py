"""The suite's files run longest first, so that two processes finish together.

The README's test command runs the suite in two processes (pytest-xdist, ``--dist loadfile``
with ``--no-loadscope-reorder``): each process takes the next file from one queue when it is
done with its own. The queue is in collection order, and this module sorts that order by what
each file took in a measured run (``tests/durations.json``, written by
``tools/test_durations.py`` from a JUnit file), longest first: the long files (the main job,
the vLLM engines, the million-row plans) start at once on both processes and the short ones
fill the end, instead of one long file starting last and running alone. Files missing from
the table (new ones) count as :data:`UNKNOWN_S` seconds. Tests keep their order within a file,
and the sort is stable, so a run in one process is the same set of tests in another order.

Wired up by ``tests/conftest.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")

#: Seconds assumed for a file the table does not name: about a median file's.
UNKNOWN_S = 5.0


def file_durations(path: Path = DURATIONS) -> dict[str, float]:
    """The measured seconds of each test file, by path relative to the repository root; empty
    when the table is missing or unreadable (the order is then collection order)."""
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(table, dict):
        return {}
    return {str(k): float(v) for k, v in table.items() if isinstance(v, (int, float))}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    durations = file_durations()
    if not durations:
        return
    items.sort(key=lambda item: -durations.get(item.nodeid.split("::", 1)[0], UNKNOWN_S))
