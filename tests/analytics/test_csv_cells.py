"""Analytics CSV never hands a spreadsheet a formula: agent-made text is neutralised."""

from __future__ import annotations

import csv
import dataclasses
import io

from store.analytics import VIEWS, csv_cell, rows_as_csv


def test_formula_cells_are_neutralised_and_numbers_kept() -> None:
    for text in ("=1+1", "+cmd", "-2+3", "@SUM(A1)", "\t=x", "\r=x"):
        assert csv_cell(text) == "'" + text
    assert csv_cell("TypeError") == "TypeError"
    assert csv_cell(-0.5) == -0.5 and csv_cell(None) == ""


def test_a_failure_pattern_row_with_hostile_names() -> None:
    spec = VIEWS["failures"]
    fields = {f.name: None for f in dataclasses.fields(spec.row)}
    row = spec.row(**{**fields, "run_id": "r", "tool_name": "=HYPERLINK(\"http://x\")",
                      "error_type": "@evil", "failures": 3})
    [read] = list(csv.DictReader(io.StringIO(rows_as_csv(spec, [row]))))
    assert read["tool_name"] == "'=HYPERLINK(\"http://x\")"
    assert read["error_type"] == "'@evil" and read["failures"] == "3"
