"""Tasks: JSONL loading with errors naming line and field, and the generated task sets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.rollout.agent_tasks import (
    Task,
    TaskFormatError,
    arithmetic_tasks,
    function_call_tasks,
    load_tasks,
)
from workers.rollout.builtin_tools import default_tool_registry
from workers.rollout.calculator import evaluate_expression, format_number
from workers.rollout.rewards import Transcript

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}}}}

GOOD = {
    "task_id": "w1",
    "messages": [{"role": "user", "content": "Weather in Oslo?"}],
    "tools": ["calculator", WEATHER],
    "ground_truth": {"name": "get_weather", "arguments": {"city": "Oslo"}},
    "reward": "function_call",
    "max_turns": 1,
    "stop_at_tool_calls": True,
}


def _write(path: Path, *lines: object) -> Path:
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line)
                              for line in lines) + "\n")
    return path


def test_load_good_file(tmp_path: Path) -> None:
    second = dict(GOOD, task_id="a1", tools=[], reward="final_answer", ground_truth="42",
                  stop_at_tool_calls=False)
    del second["max_turns"]
    path = _write(tmp_path / "tasks.jsonl", "# comment", GOOD, "", second)
    tasks = load_tasks(path, registry=default_tool_registry())
    assert [t.task_id for t in tasks] == ["w1", "a1"]
    first = tasks[0]
    assert [s["function"]["name"] for s in first.tools] == ["calculator", "get_weather"]
    assert first.max_turns == 1 and first.stop_at_tool_calls
    assert tasks[1].max_turns is None and tasks[1].tools == ()
    assert Task(**{**first.to_dict(), "messages": first.messages,
                   "tools": first.tools}) == first


def _bad(changes: dict) -> dict:
    task = dict(GOOD)
    for key, value in changes.items():
        if value is ...:
            task.pop(key)
        else:
            task[key] = value
    return task


@pytest.mark.parametrize(("changes", "field", "detail"), [
    ({"messages": ...}, "messages", "non-empty list"),
    ({"messages": "hi"}, "messages", "non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "expected one of"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "required"),
    ({"task_id": ""}, "task_id", "non-empty string"),
    ({"tools": ["shell"]}, "tools[0]", "unknown tool 'shell'"),
    ({"tools": [{"type": "function", "function": {}}]}, "function.name", "non-empty"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "more than once"),
    ({"reward": "vibes"}, "reward", "unknown reward"),
    ({"ground_truth": ...}, "ground_truth", "required"),
    ({"ground_truth": [{"name": "get_weather", "arguments": 3}]}, "ground_truth",
     "field 'arguments'"),
    ({"max_turns": 0}, "max_turns", "positive integer"),
    ({"stop_at_tool_calls": "yes"}, "stop_at_tool_calls", "true or false"),
    ({"colour": "red"}, "colour", "unknown field"),
])
def test_bad_lines_name_line_and_field(tmp_path: Path, changes: dict, field: str,
                                       detail: str) -> None:
    path = _write(tmp_path / "tasks.jsonl", GOOD | {"task_id": "ok"}, "", _bad(changes))
    with pytest.raises(TaskFormatError) as caught:
        load_tasks(path, registry=default_tool_registry())
    message = str(caught.value)
    assert message.startswith("tasks.jsonl line 3: ")
    assert field in message and detail in message


def test_file_level_errors(tmp_path: Path) -> None:
    with pytest.raises(TaskFormatError, match=r"line 2: invalid JSON"):
        load_tasks(_write(tmp_path / "a.jsonl", GOOD, '{"task_id": '))
    with pytest.raises(TaskFormatError, match=r"line 2: field 'task_id': 'w1' already used "
                                              r"on line 1"):
        load_tasks(_write(tmp_path / "b.jsonl", GOOD, GOOD), registry=default_tool_registry())
    with pytest.raises(TaskFormatError, match="no tasks"):
        load_tasks(_write(tmp_path / "c.jsonl", "# nothing"))
    with pytest.raises(TaskFormatError, match="line 1: expected a JSON object"):
        load_tasks(_write(tmp_path / "d.jsonl", "[1, 2]"))
    with pytest.raises(FileNotFoundError):
        load_tasks(tmp_path / "missing.jsonl")


def test_arithmetic_tasks_are_deterministic_and_correct() -> None:
    tasks = arithmetic_tasks(5, seed=3)
    assert [t.to_dict() for t in tasks] == [t.to_dict() for t in arithmetic_tasks(5, seed=3)]
    assert tasks != arithmetic_tasks(5, seed=4)
    for task in tasks:
        question = task.messages[-1]["content"]
        expression = question.removeprefix("What is ").removesuffix("?")
        assert task.ground_truth == format_number(evaluate_expression(expression))
        assert task.tools[0]["function"]["name"] == "calculator"
        answer = {"role": "assistant", "content": f"The answer is {task.ground_truth}."}
        assert task.score(Transcript(messages=task.messages + (answer,),
                                     assistant_texts=(answer["content"],))).value == 1.0
    with pytest.raises(ValueError, match="count"):
        arithmetic_tasks(0)


def test_function_call_tasks() -> None:
    tasks = function_call_tasks(4, seed=1)
    assert {t.reward for t in tasks} == {"function_call"}
    assert all(t.stop_at_tool_calls and t.max_turns == 1 for t in tasks)
    names = {t.ground_truth[0]["name"] for t in tasks}
    assert names == {"get_weather", "convert_currency"}
    with pytest.raises(ValueError, match="count"):
        function_call_tasks(-1)
