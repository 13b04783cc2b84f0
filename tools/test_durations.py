"""Write ``tests/durations.json``: the seconds each test file took in a run, from its JUnit
file, longest first (``tests/ordering.py`` runs files in that order).

    python3 -m pytest -n 2 --dist loadfile --no-loadscope-reorder --junitxml=run.xml
    python3 tools/test_durations.py run.xml

A test's time is its setup, call and teardown together (pytest's ``time`` attribute); a
file's is the sum over its tests. Files the table names and the run did not include keep
their time. Exits 2 naming the file when it is not a JUnit file.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "durations.json"


def durations(junit: Path) -> dict[str, float]:
    """Seconds per test file (``tests/.../test_x.py``) in the JUnit file ``junit``."""
    per_file: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit).getroot().iter("testcase"):
        classname = case.get("classname", "")
        # classname is the module path dotted, with a test class appended when there is one
        parts = classname.split(".")
        for end in range(len(parts), 0, -1):
            candidate = "/".join(parts[:end]) + ".py"
            if (OUT.parents[1] / candidate).is_file():
                per_file[candidate] += float(case.get("time", 0.0))
                break
    return dict(sorted(((k, round(v, 1)) for k, v in per_file.items()),
                       key=lambda kv: (-kv[1], kv[0])))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: tools/test_durations.py JUNIT_XML", file=sys.stderr)
        return 2
    try:
        table = durations(Path(argv[0]))
    except (OSError, ET.ParseError) as exc:
        print(f"error: {argv[0]} is not a readable JUnit file: {exc}", file=sys.stderr)
        return 2
    try:  # files the run did not include (``--ignore``, ``-k``) keep their measured time
        kept = json.loads(OUT.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        kept = {}
    table = dict(sorted({**kept, **table}.items(), key=lambda kv: (-kv[1], kv[0])))
    OUT.write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
    print(f"{len(table)} files, {sum(table.values()):.0f} s in all -> {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
