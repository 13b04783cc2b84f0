"""Resuming an episode from its stored events (the loop's ``resume``), on the real store with
scripted turns forced through the tiny model: the "worker" dies at a chosen append (the log
refuses it and every later one, as a SIGKILLed process leaves its stream), and the episode
is continued by a second play that reads the stream. Recorded LLM calls are not generated
again, recorded tool results not run again, a non-idempotent tool that was running at the
crash not run again, and the resumed episode trains into the samples of an uninterrupted
one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from store.eventlog import NO_STREAM, EventStore, run_stream_id
from store.events import Event, LLMCalled, RollbackConfig, RunConfig, RunCreated, ToolReturned
from tests.rollout.test_loop_samples import stored_samples
from tests.rollout.turns import tool_call, turn
from workers.engines.backend import SamplingParams
from workers.engines.backend_replay import ReplayBackend
from workers.engines.backend_transformers import TransformersBackend
from workers.replay.jobs.project import project_episode
from workers.rollout.agent_tasks import Task
from workers.rollout.episode_writer import EpisodeWriter, deterministic_event_id
from workers.rollout.group import episode_id_for, group_id_for, play_group
from workers.rollout.group_log import StoreGroupLog
from workers.rollout.loop import INTERRUPTED_TOOL_ERROR, EpisodeResult, run_episode
from workers.rollout.tools import ToolOutcome, ToolRegistry, function_schema

NAMESPACE = uuid.UUID("6a1f3c2e-4b5d-4e6f-8a9b-0c1d2e3f4a5b")
SAMPLING = SamplingParams(temperature=1.0, max_tokens=256, seed=11)


class Ledger:
    """A tool with an effect: each call appends its line to a file (its executions are the
    file's lines)."""

    name = "ledger"
    schema = function_schema("ledger", description="Write a line to the ledger.",
                             properties={"line": {"type": "string"}}, required=["line"])

    def __init__(self, path: Path, *, idempotent: bool = False, hang_after: str | None = None
                 ) -> None:
        self.path = path
        self.idempotent = idempotent
        self.hang_after = hang_after  # this line is written, then the call never returns

    def __call__(self, arguments: dict[str, Any]) -> ToolOutcome:
        with self.path.open("a") as f:
            f.write(arguments["line"] + "\n")
        if arguments["line"] == self.hang_after:
            self.path.with_suffix(".running").touch()
            time.sleep(600)
        return ToolOutcome(output=f"wrote {arguments['line']}")

    def lines(self) -> list[str]:
        return self.path.read_text().splitlines() if self.path.exists() else []


TASK = Task(task_id="ledger-task", messages=({"role": "user", "content": "Write a and b."},),
            tools=(Ledger.schema,), ground_truth="2", reward="final_answer")
SCRIPT = [turn("first", tool_call("ledger", line="a")),
          turn("second", tool_call("ledger", line="b")),
          "Wrote 2 lines."]


class DyingLog:
    """The store, until the append numbered ``die_at`` (1-based): that one and every later
    one raise, as a killed worker's appends never land."""

    def __init__(self, store: EventStore, die_at: int) -> None:
        self.store, self.die_at, self.appends = store, die_at, 0

    def append(self, stream_id: str, events: Sequence[Event], expected_version: Any = "any"
               ) -> Any:
        self.appends += 1
        if self.appends >= self.die_at:
            raise RuntimeError("the worker is gone")
        return self.store.append(stream_id, events, expected_version)

    def stream_version(self, stream_id: str) -> int:
        return self.store.stream_version(stream_id)


def new_run(store: EventStore, tiny_model_dir: Path) -> tuple[str, RunConfig]:
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    config = RunConfig(group_size=1, tokenizer=str(tiny_model_dir),
                       rollback=RollbackConfig(enable_tool_rollback=False))
    store.append(run_stream_id(run_id), [RunCreated(run_id=run_id, config=config)], NO_STREAM)
    return run_id, config


def play(store: Any, backend: ReplayBackend, ledger: Ledger, run_id: str, config: RunConfig,
         episode: str, *, resume: list[Event] | None = None,
         policy_version: int | None = None) -> EpisodeResult:
    writer = EpisodeWriter(store, namespace=NAMESPACE)
    if resume is not None:
        writer.start(episode, len(resume))
    return run_episode(task=TASK, backend=backend, tools=ToolRegistry([ledger]), sink=writer,
                       run_id=run_id, episode_id=episode, sampling=SAMPLING, rollback=config,
                       resume=resume, policy_version=policy_version)


def events_of(store: EventStore, episode: str) -> list[Event]:
    return [r.event for r in store.read_stream(episode)]


def crash_then_resume(store: EventStore, hf_backend: TransformersBackend, tmp_path: Path,
                      tiny_model_dir: Path, *, die_at: int, idempotent: bool,
                      resumed_script: list[str], idempotent_on_resume: bool | None = None,
                      ) -> tuple[str, Ledger, ReplayBackend, EpisodeResult]:
    run_id, config = new_run(store, tiny_model_dir)
    ledger = Ledger(tmp_path / f"ledger-{die_at}-{idempotent}.txt", idempotent=idempotent)
    episode = f"ep-{uuid.uuid4().hex[:8]}"
    with pytest.raises(RuntimeError, match="the worker is gone"):
        play(DyingLog(store, die_at), ReplayBackend(hf_backend, SCRIPT), ledger, run_id,
             config, episode)
    stored = events_of(store, episode)
    assert stored and stored[-1].type != "episode_finished"
    if idempotent_on_resume is not None:
        ledger.idempotent = idempotent_on_resume
    backend = ReplayBackend(hf_backend, resumed_script)
    result = play(store, backend, ledger, run_id, config, episode, resume=stored)
    events = events_of(store, episode)
    # No duplicate and no gap: every event at its own version, the stored ones unchanged.
    assert [e.event_id for e in events] == [deterministic_event_id(NAMESPACE, episode, v)
                                            for v in range(1, len(events) + 1)]
    assert [e.event_id for e in events[:len(stored)]] == [e.event_id for e in stored]
    return episode, ledger, backend, result


def test_a_resumed_episode_trains_into_the_samples_of_an_uninterrupted_one(
        store: EventStore, hf_backend: TransformersBackend, tmp_path: Path,
        tiny_model_dir: Path) -> None:
    run_id, config = new_run(store, tiny_model_dir)
    reference = f"ep-{uuid.uuid4().hex[:8]}"
    ref_ledger = Ledger(tmp_path / "reference.txt")
    ref = play(store, ReplayBackend(hf_backend, SCRIPT), ref_ledger, run_id, config,
               reference)
    assert (ref.status, ref.reason) == ("completed", None) and ref_ledger.lines() == ["a", "b"]

    # Appends: [started], [call 1, checkpoint] (before the ledger runs), [result a],
    # [call 2, checkpoint], [result b], [call 3, reward, finished]. Dying at the 4th leaves
    # call 1 and its result stored: call 2 and 3 are generated, "a" is not written again.
    episode, ledger, backend, result = crash_then_resume(
        store, hf_backend, tmp_path, tiny_model_dir, die_at=4, idempotent=False,
        resumed_script=SCRIPT[1:])
    assert result.status == "completed" and result.reward is not None
    assert result.reward.value == ref.reward.value if ref.reward else False
    assert backend.remaining == 0  # call 1 came from the log, not from the engine
    assert ledger.lines() == ["a", "b"]  # each line written once

    ref_calls = [e for e in events_of(store, reference) if isinstance(e, LLMCalled)]
    calls = [e for e in events_of(store, episode) if isinstance(e, LLMCalled)]
    assert [c.call_id for c in calls] == ["call_1", "call_2", "call_3"]
    for mine, theirs in zip(calls, ref_calls, strict=True):
        assert mine.prompt_ids.tolist() == theirs.prompt_ids.tolist()
        assert mine.response_ids.tolist() == theirs.response_ids.tolist()
        np.testing.assert_array_equal(mine.logprobs, theirs.logprobs)
    assert [e.type for e in events_of(store, episode)] == [
        e.type for e in events_of(store, reference)]

    assert project_episode(store, reference).outcome == "written"
    assert project_episode(store, episode).outcome == "written"
    want, got = stored_samples(store, reference), stored_samples(store, episode)
    assert set(got) == set(want) and got
    for key, sample in want.items():
        assert got[key]["ids"] == sample["ids"] and got[key]["mask"] == sample["mask"]
        assert got[key]["reward"] == sample["reward"]
        np.testing.assert_array_equal(got[key]["logprobs"], sample["logprobs"])


@pytest.mark.parametrize("idempotent", [False, True])
def test_a_tool_running_at_the_crash_runs_again_only_when_idempotent(
        store: EventStore, hf_backend: TransformersBackend, tmp_path: Path,
        tiny_model_dir: Path, idempotent: bool) -> None:
    # A non-idempotent tool runs once the call asking for it is stored: dying at the 3rd
    # append, "a" was written, its result never stored, and call 1 is in the log. An
    # idempotent one runs without waiting for the store: dying at the 2nd append, "a" was
    # written and nothing after episode_started is stored, so call 1 is generated again and
    # "a" written again.
    episode, ledger, backend, result = crash_then_resume(
        store, hf_backend, tmp_path, tiny_model_dir, die_at=2 if idempotent else 3,
        idempotent=idempotent, resumed_script=SCRIPT if idempotent else SCRIPT[1:])
    assert backend.remaining == 0 and result.status == "completed"
    first = next(e for e in events_of(store, episode) if isinstance(e, ToolReturned))
    if idempotent:
        assert ledger.lines() == ["a", "a", "b"]
        assert first.output == "wrote a" and not first.is_error
    else:
        assert ledger.lines() == ["a", "b"]  # never run twice
        assert first.is_error and first.error_type == INTERRUPTED_TOOL_ERROR
        assert "not run again" in first.output
        # The loop goes on as after any tool error: the error is in the next call's context.
        call_2 = [e for e in events_of(store, episode) if isinstance(e, LLMCalled)][1]
        assert call_2.messages[-1]["content"] == first.output


def test_a_recorded_call_whose_idempotent_tool_has_no_result_runs_it_again(
        store: EventStore, hf_backend: TransformersBackend, tmp_path: Path,
        tiny_model_dir: Path) -> None:
    """Call 1 is stored, its tool's result is not (dying at the 3rd append); the tool is
    declared idempotent where the episode resumes: it runs again, call 1 is not generated
    again."""
    episode, ledger, backend, result = crash_then_resume(
        store, hf_backend, tmp_path, tiny_model_dir, die_at=3, idempotent=False,
        resumed_script=SCRIPT[1:], idempotent_on_resume=True)
    assert backend.remaining == 0 and result.status == "completed"
    assert ledger.lines() == ["a", "a", "b"]
    first = next(e for e in events_of(store, episode) if isinstance(e, ToolReturned))
    assert first.output == "wrote a" and not first.is_error


def test_a_log_the_replay_does_not_reproduce_ends_the_episode_in_error(
        store: EventStore, hf_backend: TransformersBackend, tmp_path: Path,
        tiny_model_dir: Path) -> None:
    run_id, config = new_run(store, tiny_model_dir)
    ledger = Ledger(tmp_path / "ledger.txt")
    episode = f"ep-{uuid.uuid4().hex[:8]}"
    with pytest.raises(RuntimeError):
        play(DyingLog(store, 4), ReplayBackend(hf_backend, SCRIPT), ledger, run_id, config,
             episode)
    stored = events_of(store, episode)
    backend = ReplayBackend(hf_backend, SCRIPT[1:])
    result = play(store, backend, ledger, run_id, config, episode, resume=stored,
                  policy_version=3)
    assert result.status == "error" and result.reason is not None
    assert "policy version 0" in result.reason and "serves 3" in result.reason
    assert backend.remaining == 2 and ledger.lines() == ["a"]  # nothing generated or run
    events = events_of(store, episode)
    # No reward: the episode's samples are never ready, so it is never trained.
    assert [e.type for e in events[len(stored):]] == ["episode_finished"]
    assert events[-1].status == "error" and result.reward is None
    assert project_episode(store, episode).outcome == "written"
    assert {s["status"] for s in stored_samples(store, episode).values()} == {"no_reward"}

    with pytest.raises(ValueError, match="resume must be an episode's stored events"):
        play(store, backend, ledger, run_id, config, "other", resume=stored[1:])


def test_a_sigkilled_player_is_resumed_and_its_tool_not_run_twice(
        store: EventStore, pg_url: str, hf_backend: TransformersBackend, tmp_path: Path,
        tiny_model_dir: Path) -> None:
    """A real process plays a group of one and is SIGKILLed while its first tool call runs
    (the line is written, the result never stored); the next play of the group resumes the
    episode: call 1 from the log, the interrupted call answered with an error instead of a
    second run, and the episode finished, with every line written once."""
    run_id, _ = new_run(store, tiny_model_dir)
    ledger = Ledger(tmp_path / "ledger.txt")
    player = subprocess.Popen(
        [sys.executable, "-m", "tests.rollout.resume_player", pg_url, str(tmp_path / "data"),
         run_id, str(tiny_model_dir), str(ledger.path)],
        cwd=Path(__file__).resolve().parents[2], stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "player.log", "w"))  # noqa: SIM115
    try:
        running = ledger.path.with_suffix(".running")
        deadline = time.monotonic() + 240
        while not running.exists():
            assert player.poll() is None, (tmp_path / "player.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the player never ran the tool"
            time.sleep(0.2)
        os.kill(player.pid, signal.SIGKILL)
    finally:
        player.kill()
        player.wait()
    episode = episode_id_for(group_id_for(run_id, TASK.task_id, 0, 0), 0)
    stored = events_of(store, episode)
    assert [e.type for e in stored] == ["episode_started", "llm_called", "checkpoint_created"]
    assert ledger.lines() == ["a"]

    backend = ReplayBackend(hf_backend, SCRIPT[1:])
    result = play_group(log=StoreGroupLog(store), run_id=run_id, task=TASK, backend=backend,
                        tools=ToolRegistry([ledger]), policy_version=0)
    (slot,) = result.slots
    assert (slot.episode_id, slot.resumed, slot.played, slot.status) == (
        episode, True, True, "completed")
    assert backend.remaining == 0 and ledger.lines() == ["a", "b"]
    events = events_of(store, episode)
    assert [e.event_id for e in events[:3]] == [e.event_id for e in stored]
    interrupted = next(e for e in events if isinstance(e, ToolReturned))
    assert interrupted.error_type == INTERRUPTED_TOOL_ERROR
    assert [e.type for e in events].count("llm_called") == 3
