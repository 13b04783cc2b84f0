"""``@pytest.mark.isolated``: a test that runs in a fresh Python process of its own.

Some tests depend on state of the whole process that an earlier test may have changed: the
threads vLLM's CPU worker binds and torch's thread count (a reduction split over other threads
adds in another order), global random seeds. Where such a test cannot stop depending on it,
it is marked ``isolated``: the session hands it to a child ``python -m pytest <node id>``
started for it, and reports the child's setup, call and teardown as its own (the terminal
line, ``-x``, the JUnit file and ``--durations`` see them as usual).

``@pytest.mark.isolated("name")`` puts the marked tests of one name in the same child, run
there in the session's order, so that they share what their module starts once (an engine)
without leaving it behind in the session's process; the child starts when the session reaches
the first of them. Each test keeps its own time limit; the child's is their sum.

Wired up by ``tests/conftest.py``; ``TRAJSTORE_TEST_ISOLATED_REPORTS`` is how a child knows it
is one (it runs its tests in place and writes their reports to that file).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from _pytest.reports import TestReport

REPORTS_ENV = "TRAJSTORE_TEST_ISOLATED_REPORTS"
_RESULTS = pytest.StashKey[dict[str, list[TestReport]]]()
_LIMIT = pytest.StashKey[float]()


def _group(item: pytest.Item) -> str | None:
    """The name of the child ``item`` runs in (its node id when the marker names none), or
    None for a test of this process (and for every test inside a child)."""
    marker = item.get_closest_marker("isolated")
    if marker is None or os.environ.get(REPORTS_ENV):
        return None
    return str(marker.args[0]) if marker.args else item.nodeid


class _ReportWriter:
    """In a child: every report, one JSON line each, appended to the parent's file."""

    def __init__(self, config: pytest.Config, path: str) -> None:
        self.config = config
        self.path = path

    def pytest_runtest_logreport(self, report: TestReport) -> None:
        data = self.config.hook.pytest_report_to_serializable(config=self.config,
                                                              report=report)
        with open(self.path, "a") as f:
            f.write(json.dumps(data) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    path = os.environ.get(REPORTS_ENV)
    if path:
        config.pluginmanager.register(_ReportWriter(config, path), "isolated-report-writer")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Here the item's time limit becomes the child's business: the parent's own timer (which
    # would run around the whole child) is switched off, and the limit kept for the child's.
    for item in items:
        if _group(item) is None:
            continue
        marker = item.get_closest_marker("timeout")
        limit = marker.args[0] if marker and marker.args else item.config.getini("timeout")
        item.stash[_LIMIT] = float(limit or 0)
        item.add_marker(pytest.mark.timeout(0), append=False)


def _run_group(item: pytest.Item, group: str) -> dict[str, list[TestReport]]:
    """Run the tests of ``group`` in a child; their reports by node id."""
    members = [i for i in item.session.items if _group(i) == group]
    factory = getattr(item.config, "_tmp_path_factory", None)
    folder = Path(factory.mktemp("isolated")) if factory else Path(
        tempfile.mkdtemp(prefix="trajstore-isolated-"))
    reports_file = folder / "reports.jsonl"
    log = folder / "output.log"
    limits = [m.stash.get(_LIMIT, 0.0) for m in members]
    timeout = None if 0.0 in limits else sum(limits) + 120
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "--rootdir", str(item.config.rootpath), "--basetemp", str(folder / "tmp"),
               *[m.nodeid for m in members]]
    env = dict(os.environ, **{REPORTS_ENV: str(reports_file)})
    with open(log, "wb") as out:
        try:
            done = subprocess.run(command, cwd=item.config.rootpath, env=env, stdout=out,
                                  stderr=subprocess.STDOUT, timeout=timeout)
            ended = f"exited with status {done.returncode}"
        except subprocess.TimeoutExpired:
            ended = f"was stopped after {timeout:.0f} s"
    results: dict[str, list[TestReport]] = {m.nodeid: [] for m in members}
    if reports_file.exists():
        for line in reports_file.read_text().splitlines():
            report = item.config.hook.pytest_report_from_serializable(
                config=item.config, data=json.loads(line))
            results.setdefault(report.nodeid, []).append(report)
    tail = log.read_text(errors="replace")[-6000:]
    for member in members:
        if not any(r.when == "call" or r.failed or r.skipped for r in results[member.nodeid]):
            results[member.nodeid].append(TestReport(
                member.nodeid, member.location, {}, "failed",
                f"the isolated process ({' '.join(command)}) {ended} without reporting "
                f"this test; its output ends with:\n{tail}", "call"))
    return results


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    group = _group(item)
    if group is None:
        return None
    results = item.session.stash.setdefault(_RESULTS, {})
    if item.nodeid not in results:
        results.update(_run_group(item, group))
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for report in results.pop(item.nodeid):
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True
