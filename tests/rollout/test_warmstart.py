"""The warm start of the ``calc`` family: the scripted solver's transcripts, the cached
fine-tuned model with its checksums, and a corrupt cache being rebuilt (never loaded)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from workers.engines.tinymodel import build_tiny_model
from workers.engines.toolcall import parse_response
from workers.rollout.rewards import Transcript, tool_answer_reward
from workers.rollout.warmstart import (
    WarmStartCacheError,
    WarmStartOptions,
    is_warm_start,
    solver_transcripts,
    verify_warm_start,
    warm_start_path,
)

SMALL = WarmStartOptions(transcripts=8, steps=2, batch_size=4, drills=2)


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
    with pytest.raises(ValueError, match="hidden_size"):
        warm_start_path(tmp_path, options=WarmStartOptions(hidden_size=0))
    with pytest.raises(ValueError, match="drills"):
        warm_start_path(tmp_path, options=WarmStartOptions(drills=-1))
    with pytest.raises(ValueError, match="processes"):
        warm_start_path(tmp_path, options=WarmStartOptions(processes=0))


def test_two_processes_train_the_weights_of_one(tmp_path: Path) -> None:
    """Data parallel over two processes: each scores its share of the rows, the gradients
    are summed, and the weights come out as one process trains them (up to the order of
    floating-point sums)."""
    import dataclasses

    from safetensors.torch import load_file

    options = dataclasses.replace(SMALL, transcripts=12, steps=3, batch_size=3, drills=5)
    one = load_file(warm_start_path(tmp_path / "one", options=dataclasses.replace(
        options, processes=1)) / "model.safetensors")
    two = load_file(warm_start_path(tmp_path / "two", options=options) / "model.safetensors")
    untrained = load_file(build_tiny_model(tmp_path / "raw", seed=0) / "model.safetensors")
    assert one.keys() == two.keys()
    moved = 0.0
    # Adam moves every weight by about lr (3e-3) a step whatever its gradient's size, so on
    # gradients that cancel to about eps the order of the sums moves the update by ~1e-5;
    # a rank that trained on its half alone would be off by about lr.
    for name, weights in one.items():
        assert torch.allclose(weights, two[name], atol=2e-4), name
        moved = max(moved, float((weights - untrained[name]).abs().max()))
    assert moved > 1e-3  # the steps did change the weights


@pytest.mark.isolated  # bit for bit needs torch's threads as a fresh process has them
def test_one_process_plays_both_ranks_where_none_can_be_spawned(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """From a daemonic process or a script that is not on disk no child can be spawned: the
    process plays both ranks in turn and adds their gradients as gloo does, so the cached
    weights are the same, bit for bit."""
    import dataclasses

    from workers.rollout import warmstart

    options = dataclasses.replace(SMALL, transcripts=12, steps=3, batch_size=3, drills=5)
    spawned = warm_start_path(tmp_path / "spawned", options=options)
    monkeypatch.setattr(warmstart, "_can_spawn", lambda: False)
    alone = warm_start_path(tmp_path / "alone", options=options)
    assert verify_warm_start(alone)["sha256"] == verify_warm_start(spawned)["sha256"]


def test_prefix_cached_loss_equals_the_full_forward(tmp_path: Path) -> None:
    """The fine-tuning loss computed over the shared prefix's cached keys and values is the
    loss of the whole transcripts (the same forward pass, computed once for the prefix)."""
    import torch
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from workers.engines.tinymodel import build_tiny_model
    from workers.rollout.agent_tasks import calc_task
    from workers.rollout.warmstart import (
        _common_prefix,
        _drill_chunks,
        _encode,
        _labelled,
        _suffix_loss_sum,
    )

    def mean(parts: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
        return sum(total for total, _ in parts) / sum(count for _, count in parts)

    path = build_tiny_model(tmp_path / "m", seed=3)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32)
    tools = [dict(t) for t in calc_task(0, 0).tools]
    data = [_encode(tokenizer, t, tools) for t in solver_transcripts(6, seed=2)]
    prefix = _common_prefix([ids for ids, _ in data])
    assert 300 < prefix < min(len(ids) for ids, _ in data)
    width = max(len(ids) for ids, _ in data)
    input_ids = torch.zeros((len(data), width), dtype=torch.long)
    labels = torch.full((len(data), width), -100, dtype=torch.long)
    attention = torch.zeros((len(data), width), dtype=torch.long)
    for row, (ids, mask) in enumerate(data):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        attention[row, :len(ids)] = 1
        labels[row, :len(ids)] = torch.tensor(
            [t if m else -100 for t, m in zip(ids, mask, strict=True)])
    with torch.no_grad():
        full = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        cached = mean([_suffix_loss_sum(model, data, prefix, pad=0)])
        drills = [(ids[prefix:], mask[prefix:]) for ids, mask in data]
        drill = mean([_suffix_loss_sum(model, drills, 0, pad=0)])
        chunked = mean([_suffix_loss_sum(model, chunk, 0, pad=0)
                        for chunk in _drill_chunks(drills, 4)])
    assert abs(float(cached) - float(full)) < 1e-5
    # Drills computed in length-sorted chunks: the same mean as one padded batch.
    assert abs(float(chunked) - float(drill)) < 1e-5
    # A drill (the same suffixes without the prefix) is another loss: the prefix matters.
    assert abs(float(drill) - float(full)) > 1e-3
    # The counts the data-parallel ranks normalize by, known before any forward pass.
    with torch.no_grad():
        assert _labelled(data, prefix) == _suffix_loss_sum(model, data, prefix, pad=0)[1]
        assert _labelled(drills, 0) == _suffix_loss_sum(model, drills, 0, pad=0)[1]


def test_cache_is_checked_and_a_corrupt_one_rebuilt(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    path = warm_start_path(tmp_path, seed=0, options=SMALL)
    manifest = verify_warm_start(path)
    # A resumed demo run tells its task family by this.
    assert is_warm_start(str(path)) and not is_warm_start(tmp_path) and not is_warm_start(None)
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
