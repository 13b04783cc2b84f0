"""Training metrics trackers: jsonl output, unknown trackers refused by name, TensorBoard when installed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.trainer.trackers import make_trackers


def test_jsonl_tracker_writes_one_line_per_step(tmp_path: Path) -> None:
    (tracker,) = make_trackers("jsonl", tmp_path)
    tracker.log({"loss": 0.5, "nan": float("nan"), "name": "x"}, step=1)
    tracker.log({"loss": 0.25}, step=2)
    tracker.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25}]


def test_unknown_tracker_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'mlflowx'"):
        make_trackers("jsonl,mlflowx", tmp_path)


def test_tensorboard_tracker_writes_events(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="tensorboard not installed")
    (tracker,) = make_trackers("tensorboard", tmp_path)
    tracker.log({"loss": 1.0}, step=0)
    tracker.close()
    assert any((tmp_path / "tensorboard").iterdir())
