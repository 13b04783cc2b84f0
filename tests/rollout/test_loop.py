"""The agent loop with rollback, driven by forced outputs through the real tiny model.

Scripted turns go through :class:`ReplayBackend`: every prompt is rendered by the real chat
template and every forced token is scored by the real model, so the events carry real token ids
and logprobs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from store.events import Event, RollbackConfig, RunConfig, parse_event
from tests.rollout.turns import tool_call, turn
from workers.engines.backend import GenerationRequest, SamplingParams
from workers.engines.backend_replay import ReplayBackend
from workers.engines.backend_transformers import TransformersBackend
from workers.rollout.agent_tasks import Task, arithmetic_tasks, function_call_tasks
from workers.rollout.calculator import Calculator
from workers.rollout.loop import EpisodeResult, run_episode
from workers.rollout.sandbox import PythonTool
from workers.rollout.sink import ListSink
from workers.rollout.tools import ToolRegistry

TASK = Task(
    task_id="six-sevens",
    messages=({"role": "user", "content": "What is 6 * 7?"},),
    tools=(Calculator.schema, PythonTool.schema),
    ground_truth="42",
    reward="final_answer",
)
SAMPLING = SamplingParams(temperature=1.0, max_tokens=256)


def play(backend: TransformersBackend, registry: ToolRegistry, script: list[str], *,
         task: Task = TASK, **options: Any) -> tuple[EpisodeResult, list[Event], ReplayBackend]:
    replay = ReplayBackend(backend, script)
    sink = ListSink()
    options.setdefault("sampling", SAMPLING)
    result = run_episode(task=task, backend=replay, tools=registry, sink=sink, run_id="run-1",
                         episode_id="episode-1", **options)
    return result, sink.events("episode-1"), replay


def of_type(events: list[Event], name: str) -> list[Any]:
    return [event for event in events if event.type == name]


def test_rollback_event_sequence_and_final_context(hf_backend: TransformersBackend,
                                                   registry: ToolRegistry) -> None:
    failed = turn("use python", tool_call("python", code="print(undefined)"))
    fixed = turn("fixed", tool_call("python", code="print(6 * 7)"))
    result, events, replay = play(hf_backend, registry, [failed, fixed, "The answer is 42."])

    assert [e.type for e in events] == [
        "episode_started",
        "llm_called", "checkpoint_created", "tool_returned",
        "attempt_failed", "llm_called", "rolled_back",
        "checkpoint_created", "tool_returned",
        "llm_called",
        "reward_assigned", "episode_finished",
    ]
    calls = of_type(events, "llm_called")
    first_checkpoint, second_checkpoint = of_type(events, "checkpoint_created")
    (attempt,) = of_type(events, "attempt_failed")
    (rolled,) = of_type(events, "rolled_back")
    failed_result, fixed_result = of_type(events, "tool_returned")

    assert (first_checkpoint.position_key, first_checkpoint.retry_count) == ("turn_1", 0)
    assert (second_checkpoint.position_key, second_checkpoint.retry_count) == ("turn_1", 1)
    assert failed_result.error_type == "NameError" and failed_result.is_error
    assert attempt.checkpoint_id == first_checkpoint.checkpoint_id == rolled.checkpoint_id
    assert attempt.failed_call_id == calls[0].call_id
    assert attempt.retry_index == 0 and attempt.error_types == ["NameError"]
    assert attempt.failed_tool_calls == [{"id": f"{calls[0].call_id}-0", "name": "python",
                                          "arguments": {"code": "print(undefined)"}}]
    assert rolled.discarded_call_ids == [calls[0].call_id]
    assert fixed_result.output == "42\n" and not fixed_result.is_error

    # The regeneration saw the failed turn and the feedback ...
    regeneration_request = calls[1].messages
    assert regeneration_request[:-1] == [*TASK.messages, calls[0].response]
    feedback = regeneration_request[-1]
    assert feedback["role"] == "user" and "NameError" in feedback["content"]
    # ... but after the rollback both are gone: the new call took the old one's place.
    assert calls[2].messages == [
        *TASK.messages, calls[1].response,
        {"role": "tool", "tool_call_id": f"{calls[1].call_id}-0", "name": "python",
         "content": "42\n"}]
    assert list(result.messages) == calls[2].messages + [calls[2].response]
    context_text = repr(result.messages)
    assert "undefined" not in context_text and "failed with the following" not in context_text

    assert (result.status, result.reason) == ("completed", None)
    assert result.reward.value == 1.0 and of_type(events, "reward_assigned")[0].value == 1.0
    assert of_type(events, "episode_finished")[0].status == "completed"
    assert (result.llm_calls, result.tool_calls, result.rollbacks) == (3, 2, 1)
    assert replay.remaining == 0


def test_events_carry_exact_tokens_and_round_trip(hf_backend: TransformersBackend,
                                                  registry: ToolRegistry) -> None:
    script = [turn("calc", tool_call("calculator", expression="6 * 7")), "It is 42."]
    result, events, _ = play(hf_backend, registry, script)
    assert result.status == "completed"
    for call in of_type(events, "llm_called"):
        request = GenerationRequest(sampling=SAMPLING, messages=tuple(call.messages),
                                    tools=tuple(call.tools))
        assert call.prompt_ids.tolist() == hf_backend.prompt_ids(request)
        np.testing.assert_allclose(
            call.logprobs, hf_backend.score(call.prompt_ids, call.response_ids), atol=1e-6)
        assert call.usage == {"prompt_tokens": len(call.prompt_ids),
                              "completion_tokens": len(call.response_ids)}
    assert of_type(events, "llm_called")[0].finish_reason == "tool_calls"
    assert of_type(events, "llm_called")[1].finish_reason == "stop"
    for event in events:
        assert event.event_id is not None and event.occurred_at is not None
        again = parse_event(event.type, event.to_data(), tokens=event.token_payloads() or None,
                            event_id=event.event_id, occurred_at=event.occurred_at)
        assert again.to_data() == event.to_data()
    started = events[0]
    assert (started.run_id, started.group_id, started.task_id) == (
        "run-1", "run-1:six-sevens:v0", "six-sevens")
    assert started.sampling_params == SAMPLING.to_dict()


def test_retries_are_counted_per_position_and_the_limit_terminates(
        hf_backend: TransformersBackend, registry: ToolRegistry) -> None:
    script = [
        turn("a", tool_call("python", code="print(x)")),           # turn_1 fails: NameError
        turn("b", tool_call("python", code="print(")),             # turn_1 fails: SyntaxError
        turn("c", tool_call("calculator", expression="6 * 7")),    # turn_1 succeeds (2 retries)
        turn("d", tool_call("python", code="import nope_mod")),    # turn_2 fails
        turn("e", tool_call("python", code="import nope_mod2")),   # turn_2 fails
        turn("f", tool_call("python", code="import nope_mod3")),   # turn_2 fails: over the limit
    ]
    result, events, replay = play(hf_backend, registry, script,
                                  rollback=RollbackConfig(max_tool_retries=2))
    checkpoints = [(e.position_key, e.retry_count) for e in of_type(events, "checkpoint_created")]
    assert checkpoints == [("turn_1", 0), ("turn_1", 1), ("turn_1", 2),
                           ("turn_2", 0), ("turn_2", 1), ("turn_2", 2)]
    attempts = [(e.position_key, e.retry_index) for e in of_type(events, "attempt_failed")]
    assert attempts == [("turn_1", 0), ("turn_1", 1), ("turn_2", 0), ("turn_2", 1), ("turn_2", 2)]
    assert len(of_type(events, "rolled_back")) == 4
    assert [e.type for e in events[-4:]] == ["tool_returned", "attempt_failed",
                                             "reward_assigned", "episode_finished"]
    assert result.status == "terminated"
    assert result.reason == ("tool calls at turn_2 still failed after 2 retries "
                             "(ModuleNotFoundError)")
    assert of_type(events, "episode_finished")[0].status == "terminated"
    assert replay.remaining == 0 and result.llm_calls == 6  # no regeneration past the limit


def test_zero_retries_terminates_at_the_first_matching_error(
        hf_backend: TransformersBackend, registry: ToolRegistry) -> None:
    result, events, _ = play(hf_backend, registry,
                             [turn("a", tool_call("python", code="print(x)"))],
                             rollback={"max_tool_retries": 0})
    assert result.status == "terminated" and result.llm_calls == 1
    assert "rolled_back" not in [e.type for e in events]


def test_malformed_tool_call_gets_format_feedback_and_rolls_back(
        hf_backend: TransformersBackend, registry: ToolRegistry) -> None:
    broken = turn("calc", '<tool_call>\n{"name": "calculator", "arguments": {"expression": '
                          '"6 * 7"}\n</tool_call>')
    script = [broken, turn("calc", tool_call("calculator", expression="6 * 7")), "42"]
    result, events, _ = play(hf_backend, registry, script)
    invalid = of_type(events, "tool_returned")[0]
    assert invalid.name == "invalid_tool_call" and invalid.error_type == "ToolCallFormatError"
    assert invalid.output.startswith("tool call format is wrong: invalid JSON")
    attempt = of_type(events, "attempt_failed")[0]
    assert attempt.error_types == ["ToolCallFormatError"]
    assert attempt.failed_tool_calls[0]["raw"].startswith('{"name": "calculator"')
    regeneration = of_type(events, "llm_called")[1]
    assert "tool call format is wrong" in regeneration.messages[-1]["content"]
    assert result.status == "completed" and result.reward.value == 1.0
    assert "tool call format is wrong" not in repr(result.messages)


def test_without_rollback_errors_stay_in_context(hf_backend: TransformersBackend,
                                                 registry: ToolRegistry) -> None:
    script = [
        turn("a", tool_call("python", code="print(x)")),
        turn("b", '<tool_call>{"name": 1}</tool_call>'),
        "The answer is 42.",
    ]
    result, events, _ = play(hf_backend, registry, script,
                             rollback=RunConfig(rollback=RollbackConfig(
                                 enable_tool_rollback=False)))
    types = [e.type for e in events]
    assert "attempt_failed" not in types and "rolled_back" not in types
    assert types.count("checkpoint_created") == 2
    roles = [m["role"] for m in result.messages]
    assert roles == ["user", "assistant", "tool", "assistant", "user", "assistant"]
    assert "NameError" in result.messages[2]["content"]
    assert result.messages[4]["content"].startswith("tool call format is wrong")
    assert result.status == "completed"


def test_negative_samples_can_be_switched_off(hf_backend: TransformersBackend,
                                              registry: ToolRegistry) -> None:
    script = [turn("a", tool_call("python", code="print(x)")),
              turn("b", tool_call("calculator", expression="6*7")), "42"]
    _, events, _ = play(hf_backend, registry, script,
                        rollback=RollbackConfig(save_negative_samples=False))
    types = [e.type for e in events]
    assert "attempt_failed" not in types and types.count("rolled_back") == 1


def test_errors_not_in_the_patterns_do_not_roll_back(hf_backend: TransformersBackend,
                                                     registry: ToolRegistry) -> None:
    script = [turn("a", tool_call("calculator", expression="1 / 0"),
                   tool_call("calculator", expression="6 * 7")), "42"]
    result, events, _ = play(hf_backend, registry, script)
    assert "rolled_back" not in [e.type for e in events]
    tool_messages = [m for m in result.messages if m["role"] == "tool"]
    assert [m["content"] for m in tool_messages] == [
        "ZeroDivisionError: division by zero", "42"]
    assert result.tool_calls == 2


def test_only_offered_tools_can_be_called(hf_backend: TransformersBackend,
                                          registry: ToolRegistry) -> None:
    calculator_only = Task(task_id="t", messages=TASK.messages, tools=(Calculator.schema,),
                           ground_truth="42", reward="final_answer")
    script = [turn("a", tool_call("python", code="print(42)")), "42"]
    result, events, _ = play(hf_backend, registry, script, task=calculator_only)
    returned = of_type(events, "tool_returned")[0]
    assert returned.error_type == "ToolNotFoundError" and "'python'" in returned.output


def test_function_call_task_ends_at_the_call_with_egpo_reward(
        hf_backend: TransformersBackend, registry: ToolRegistry) -> None:
    task = function_call_tasks(1, seed=0)[0]
    truth = task.ground_truth[0]
    answer = turn("weather", tool_call(truth["name"], **truth["arguments"]))
    result, events, _ = play(hf_backend, registry, [answer], task=task)
    assert [e.type for e in events] == ["episode_started", "llm_called", "reward_assigned",
                                        "episode_finished"]
    assert result.status == "completed" and result.reward.value == 1.0
    # A malformed call is rolled back and retried even though the call is the answer.
    result, events, _ = play(hf_backend, registry, ["<tool_call>{oops</tool_call>", answer],
                             task=task)
    assert result.reward.value == 1.0 and result.rollbacks == 1
    no_reasoning = tool_call(truth["name"], **truth["arguments"])
    result, _, _ = play(hf_backend, registry, [no_reasoning], task=task)
    assert result.reward.value == 0.0 and result.reward.components["correct"] == 1.0


def test_truncations(hf_backend: TransformersBackend, registry: ToolRegistry) -> None:
    pending = turn("a", tool_call("calculator", expression="6 * 7"))
    result, events, _ = play(hf_backend, registry, [pending], max_turns=1)
    assert result.status == "truncated" and "max_turns (1)" in result.reason
    assert "tool_returned" not in [e.type for e in events]

    result, events, _ = play(hf_backend, registry, [pending],
                             sampling=SamplingParams(max_tokens=5))
    assert (result.status, result.reason) == ("truncated", "the response reached max_tokens")
    assert of_type(events, "llm_called")[0].finish_reason == "length"

    prompt_length = len(hf_backend.prompt_ids(GenerationRequest(
        sampling=SAMPLING, messages=TASK.messages, tools=TASK.tools)))
    result, events, _ = play(hf_backend, registry, [pending],
                             max_total_tokens=prompt_length + 10)
    assert result.status == "truncated"
    call = of_type(events, "llm_called")[0]
    assert len(call.prompt_ids) + len(call.response_ids) <= prompt_length + 10


def test_backend_failure_ends_the_episode_with_error(hf_backend: TransformersBackend,
                                                     registry: ToolRegistry) -> None:
    result, events, _ = play(hf_backend, registry,
                             [turn("a", tool_call("calculator", expression="6 * 7"))])
    assert result.status == "error" and "exhausted" in result.reason
    reward, finished = events[-2:]
    assert (reward.type, reward.value, reward.source) == ("reward_assigned", 0.0, "error")
    assert (finished.type, finished.status) == ("episode_finished", "error")


def test_sampled_episode_is_reproducible_with_a_seed(hf_backend: TransformersBackend,
                                                     registry: ToolRegistry) -> None:
    task = arithmetic_tasks(1, seed=0)[0]
    runs = []
    for _ in range(2):
        sink = ListSink()
        result = run_episode(task=task, backend=hf_backend, tools=registry, sink=sink,
                             run_id="r", episode_id="e",
                             sampling=SamplingParams(temperature=1.0, max_tokens=24, seed=7))
        assert result.status in ("completed", "truncated")
        calls = of_type(sink.events("e"), "llm_called")
        for call in calls:
            np.testing.assert_allclose(
                call.logprobs, hf_backend.score(call.prompt_ids, call.response_ids), atol=1e-4)
        runs.append([call.response_ids.tolist() for call in calls])
    assert runs[0] == runs[1]


def test_invalid_arguments_are_named(hf_backend: TransformersBackend,
                                     registry: ToolRegistry) -> None:
    sink = ListSink()
    common: dict[str, Any] = {"task": TASK, "backend": hf_backend, "tools": registry,
                              "sink": sink, "run_id": "r"}
    with pytest.raises(ValueError, match="max_turns"):
        run_episode(**common, max_turns=0)
    with pytest.raises(ValueError, match="max_total_tokens"):
        run_episode(**common, max_total_tokens=-5)
    with pytest.raises(ValueError, match="run_id"):
        run_episode(**{**common, "run_id": ""})
    with pytest.raises(ValueError, match="episode_id"):
        run_episode(**common, episode_id="")
    with pytest.raises(TypeError, match="task must be a Task"):
        run_episode(**{**common, "task": TASK.to_dict()})
    with pytest.raises(TypeError, match="backend"):
        run_episode(**{**common, "backend": object()})
    with pytest.raises(TypeError, match="sink must have an append"):
        run_episode(**{**common, "sink": object()})
    with pytest.raises(TypeError, match="tools must be a ToolRegistry"):
        run_episode(**{**common, "tools": {}})
    with pytest.raises(TypeError, match="sampling must be SamplingParams"):
        run_episode(**common, sampling={"temperature": 1.0})
    with pytest.raises(TypeError, match="rollback config"):
        run_episode(**common, rollback=3)
    with pytest.raises(ValueError, match="max_tool_retries"):
        run_episode(**common, rollback={"max_tool_retries": -1})
    assert sink.streams == {}
