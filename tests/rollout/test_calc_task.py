"""The ``calc`` tool-use task family and its strict binary ``tool_answer`` reward, played
through the real agent loop (rollback on) with scripted turns forced through the tiny model."""

from __future__ import annotations

import pytest

from tests.rollout.test_loop import of_type, play
from tests.rollout.turns import tool_call, turn
from workers.engines.backend_transformers import TransformersBackend
from workers.rollout.agent_tasks import builtin_task, calc_task, calc_tasks, load_tasks
from workers.rollout.rewards import Transcript, tool_answer_reward
from workers.rollout.tools import ToolRegistry


def test_calc_ids_are_stable_and_graded() -> None:
    task = calc_task(3, 7)
    assert builtin_task("calc-3-7") == task
    assert calc_tasks(8, seed=3)[7] == task
    assert task.reward == "tool_answer" and {t["function"]["name"] for t in task.tools} == {
        "python", "calculator"}
    with pytest.raises(ValueError, match="count"):
        calc_tasks(0)


def test_failed_call_is_rolled_back_and_the_retry_scores_one(
        hf_backend: TransformersBackend, registry: ToolRegistry) -> None:
    task = calc_task(0, 0)
    expression = task.messages[-1]["content"].removeprefix("What is ").rstrip("?")
    answer = task.ground_truth
    failed = turn("compute", tool_call("python", code=f"print({expression}"))
    fixed = turn("compute", tool_call("python", code=f"print({expression})"))
    result, events, _ = play(hf_backend, registry,
                             [failed, fixed, f"<think>\nresult\n</think>\n\n{answer}"],
                             task=task)
    assert [e.error_types for e in of_type(events, "attempt_failed")] == [["SyntaxError"]]
    assert len(of_type(events, "rolled_back")) == 1
    assert result.reward.value == 1.0 and result.rollbacks == 1


@pytest.mark.parametrize("texts, tool_output, value", [
    (["<think>\nx\n</think>\n\n" + tool_call("python", code="print(2+3)"),
      "<think>\ndone\n</think>\n\n5"], "5\n", 1.0),
    # no think block on the answer
    (["<think>\nx\n</think>\n\n" + tool_call("python", code="print(2+3)"), "5"], "5\n", 0.0),
    # the tool failed
    (["<think>\nx\n</think>\n\n" + tool_call("python", code="print(y)"),
      "<think>\ndone\n</think>\n\n5"], "Traceback\nNameError: name 'y'\n", 0.0),
    # wrong answer
    (["<think>\nx\n</think>\n\n" + tool_call("python", code="print(2+3)"),
      "<think>\ndone\n</think>\n\n6"], "5\n", 0.0),
    # no tool at all
    (["<think>\ndone\n</think>\n\n5"], None, 0.0),
])
def test_tool_answer_is_strict(texts: list[str], tool_output: str | None, value: float) -> None:
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    if tool_output is not None:
        messages.append({"role": "tool", "content": tool_output})
    got = tool_answer_reward("5", Transcript(messages=tuple(messages),
                                             assistant_texts=tuple(texts)))
    assert got.value == value


def test_ungradable_calc_task_file_is_named(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"task_id": "a", "messages": [{"role": "user", "content": "hi"}], '
                    '"tools": ["python"], "ground_truth": "many", "reward": "tool_answer"}\n')
    with pytest.raises(ValueError, match=r"t.jsonl line 1: field 'ground_truth'.*number"):
        load_tasks(path)
