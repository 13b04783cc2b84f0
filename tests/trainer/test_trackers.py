"""Training metrics trackers: jsonl output, unknown names refused, TensorBoard if installed."""

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


def test_train_cli_refuses_unknown_tracker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from trajstore.cli import app

    monkeypatch.setenv("TRAJSTORE_DATA_DIR", str(tmp_path))
    result = CliRunner().invoke(app, ["train", "--run", "r", "--trackers", "nope"])
    assert result.exit_code == 2
    assert "unknown tracker 'nope'" in result.output
    assert not (tmp_path / "train" / "r" / "metrics.jsonl").exists()
