"""The warm start of the ``calc`` family: the scripted solver's transcripts, the cached
fine-tuned model with its checksums, and a corrupt cache being rebuilt (never loaded)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from store.settings import get_settings
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


@pytest.fixture(scope="module")
def small_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clean two-process build of ``SMALL``, seed 0 (tests copy it before changing it)."""
    return warm_start_path(tmp_path_factory.mktemp("clean"), seed=0, options=SMALL)


@pytest.fixture(scope="module")
def small_weights(small_build: Path) -> dict[str, str]:
    """The SHA-256 of every file of the clean build of ``SMALL``, seed 0."""
    return verify_warm_start(small_build)["sha256"]


@pytest.fixture
def abort_once(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Path], None]]:
    """Sets ``TRAJSTORE_FAULT_WARMSTART_ABORT_ONCE`` for this test's builds (the settings are
    read once per process, so their cache is cleared before and after)."""
    def set_flag(flag: Path) -> None:
        monkeypatch.setenv("TRAJSTORE_FAULT_WARMSTART_ABORT_ONCE", os.fspath(flag))
        get_settings.cache_clear()

    yield set_flag
    monkeypatch.delenv("TRAJSTORE_FAULT_WARMSTART_ABORT_ONCE", raising=False)
    get_settings.cache_clear()


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
                                                    caplog: pytest.LogCaptureFixture,
                                                    small_build: Path) -> None:
    # The clean build, copied: found in the cache, not built again.
    shutil.copytree(small_build, tmp_path / small_build.name)
    path = warm_start_path(tmp_path, seed=0, options=SMALL)
    assert path == tmp_path / small_build.name
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


def test_a_rank_killed_by_a_signal_is_built_again(
        tmp_path: Path, abort_once: Callable[[Path], None], caplog: pytest.LogCaptureFixture,
        small_weights: dict[str, str]) -> None:
    """A spawned rank that dies of SIGABRT (as one did inside spawn on a loaded machine) is
    the machine's fault: the build starts again and comes out as a clean build, bit for bit,
    with a warning naming the rank and the signal."""
    flag = tmp_path / "aborted"
    abort_once(flag)
    with caplog.at_level(logging.WARNING, logger="workers.rollout.warmstart"):
        path = warm_start_path(tmp_path / "data", seed=0, options=SMALL)
    assert flag.exists()  # a rank did abort
    retries = [r.getMessage() for r in caplog.records if "killed by" in r.getMessage()]
    assert len(retries) == 1, retries
    assert re.search(r"rank [01] was killed by SIGABRT \(attempt 1 of 3\)", retries[0])
    assert verify_warm_start(path)["sha256"] == small_weights


def test_a_rank_that_raises_is_not_built_again(
        tmp_path: Path, abort_once: Callable[[Path], None],
        caplog: pytest.LogCaptureFixture) -> None:
    """A rank that raises is a bug a retry would repeat: the first attempt's exception comes
    out, naming the error, and nothing is cached. (Both ranks raise here: the fault's file
    cannot be created in a folder that does not exist.)"""
    from torch.multiprocessing import ProcessRaisedException

    abort_once(tmp_path / "no" / "flag")
    with caplog.at_level(logging.WARNING, logger="workers.rollout.warmstart"), \
            pytest.raises(ProcessRaisedException, match="FileNotFoundError"):
        warm_start_path(tmp_path / "data", seed=0, options=SMALL)
    assert "killed by" not in caplog.text
    assert list((tmp_path / "data").iterdir()) == []


def test_only_a_rank_killed_by_a_signal_is_retried(caplog: pytest.LogCaptureFixture) -> None:
    """The retry decision on the exceptions ``torch.multiprocessing`` raises: a signal is
    retried up to three attempts in all, then propagates; a non-zero exit code or a raised
    exception propagates at once."""
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    from workers.rollout.warmstart import SPAWN_ATTEMPTS, _retry_killed

    def failing(*errors: Exception) -> tuple[list[int], Callable[[int], float]]:
        calls: list[int] = []

        def attempt(number: int) -> float:
            calls.append(number)
            if number <= len(errors):
                raise errors[number - 1]
            return 0.5

        return calls, attempt

    def killed(rank: int) -> ProcessExitedException:
        return ProcessExitedException(f"process {rank} terminated with signal SIGKILL",
                                      error_index=rank, error_pid=1, exit_code=-9,
                                      signal_name="SIGKILL")

    exited = ProcessExitedException("process 0 terminated with exit code 3", error_index=0,
                                    error_pid=1, exit_code=3)
    raised = ProcessRaisedException("ValueError: bad", error_index=1, error_pid=1)
    for error in (exited, raised):
        calls, attempt = failing(error)
        with pytest.raises(type(error)):
            _retry_killed(attempt, what="build")
        assert calls == [1]
    with caplog.at_level(logging.WARNING, logger="workers.rollout.warmstart"):
        calls, attempt = failing(killed(1), killed(0))
        assert _retry_killed(attempt, what="build") == 0.5
    assert calls == [1, 2, 3]
    assert [r.getMessage() for r in caplog.records] == [
        "build: rank 1 was killed by SIGKILL (attempt 1 of 3); starting again in a fresh "
        "scratch folder",
        "build: rank 0 was killed by SIGKILL (attempt 2 of 3); starting again in a fresh "
        "scratch folder"]
    calls, attempt = failing(*(killed(0) for _ in range(SPAWN_ATTEMPTS)))
    with pytest.raises(ProcessExitedException, match="SIGKILL"):
        _retry_killed(attempt, what="build")
    assert calls == [1, 2, 3]
    with pytest.raises(ValueError, match="attempts"):
        _retry_killed(attempt, what="build", attempts=0)
