"""The warm start of the ``calc`` family: the scripted solver's transcripts, the cached
fine-tuned model with its checksums, and a corrupt cache being rebuilt (never loaded)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from workers.rollout.rewards import Transcript, tool_answer_reward
from workers.rollout.toolcall import parse_response
from workers.rollout.warmstart import (
    WarmStartCacheError,
    WarmStartOptions,
    solver_transcripts,
    verify_warm_start,
    warm_start_path,
)

SMALL = WarmStartOptions(transcripts=8, steps=2, batch_size=4)


def test_solver_makes_mistakes_at_the_set_rate_then_recovers() -> None:
    transcripts = solver_transcripts(200, seed=1, error_rate=0.3)
    assert transcripts == solver_transcripts(200, seed=1, error_rate=0.3)
    failed = [t for t in transcripts if any(m["role"] == "user" and "failed" in m["content"]
                                            for m in t)]
    assert 40 <= len(failed) <= 80
    kinds = set()
    for transcript in failed:
        first = parse_response(transcript[2]["content"], call_id="x")
        kinds.add("malformed" if first.format_errors else first.tool_calls[0].name)
    assert kinds >= {"malformed", "python", "calc"}
    for transcript in transcripts:
        kept = [m for m in transcript if m["role"] != "user" or "failed" not in m["content"]]
        kept_texts = [m["content"] for m in transcript[-3:] if m["role"] == "assistant"]
        reward = tool_answer_reward(transcript[-2]["content"],
                                    Transcript(messages=tuple(kept),
                                               assistant_texts=tuple(kept_texts)))
        assert reward.value == 1.0


def test_bad_options_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="error_rate"):
        solver_transcripts(3, error_rate=1.5)
    with pytest.raises(ValueError, match="steps"):
        warm_start_path(tmp_path, options=WarmStartOptions(steps=0))
    with pytest.raises(ValueError, match="seed"):
        warm_start_path(tmp_path, seed=-1)


def test_cache_is_checked_and_a_corrupt_one_rebuilt(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    path = warm_start_path(tmp_path, seed=0, options=SMALL)
    manifest = verify_warm_start(path)
    assert warm_start_path(tmp_path, seed=0, options=SMALL) == path
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-16] + b"\0" * 16)
    with pytest.raises(WarmStartCacheError, match="model.safetensors does not match"):
        verify_warm_start(path)
    with caplog.at_level(logging.WARNING):
        again = warm_start_path(tmp_path, seed=0, options=SMALL)
    assert "corrupt" in caplog.text and "rebuilding" in caplog.text
    # Rebuilt, and deterministic for the seed: the same weights as the first build.
    assert verify_warm_start(again)["sha256"] == manifest["sha256"]
    (again / "warmstart.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(WarmStartCacheError, match="unreadable"):
        verify_warm_start(again)
    assert json.loads((warm_start_path(tmp_path, seed=0, options=SMALL)
                       / "warmstart.json").read_text())["sha256"] == manifest["sha256"]
