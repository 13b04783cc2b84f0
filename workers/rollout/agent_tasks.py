"""Tasks: a prompt (chat messages), the tools offered, a ground truth and a reward by name.

User tasks are read from JSONL, one task object per line (blank lines and lines starting with
``#`` are skipped)::

    {"task_id": "weather-1",
     "messages": [{"role": "user", "content": "Weather in Paris, in celsius?"}],
     "tools": ["calculator", {"type": "function", "function": {"name": "get_weather", ...}}],
     "ground_truth": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
     "reward": "function_call",
     "max_turns": 1,
     "stop_at_tool_calls": true}

Fields: ``task_id`` (non-empty string, unique in the file), ``messages`` (non-empty list of
``{"role", "content"}`` with role system/user/assistant/tool), ``tools`` (optional list; a
string names a tool of the registry, an object is an OpenAI function schema), ``ground_truth``
(required; checked by the reward's validator), ``reward`` (a registered reward name),
``max_turns`` (optional positive integer, overrides the loop's), ``stop_at_tool_calls``
(optional boolean: the answer *is* the tool call, which is then not executed, as in
function-calling benchmarks). Any other field is an error. Every error names the file, the line
number and the field.

Built-in generated sets: :func:`arithmetic_tasks` (needs the calculator),
:func:`function_call_tasks` (EGPO-style, binary reward) and :func:`calc_tasks` (tool use with
``<think>`` reasoning, the ``calculator`` and ``python`` tools and EGPO's strict binary
``tool_answer`` reward; the demo's default). Their task ids are stable:
``arith-<seed>-<index>``, ``fc-<seed>-<index>`` and ``calc-<seed>-<index>`` always name the
same task (the ``index``-th
of the set generated with ``seed``), so a worker rebuilds any of them from its id alone
(:func:`builtin_task`). :func:`resolve_task` also looks in a folder of JSONL files.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.rollout.builtin_tools import default_tool_registry
from workers.rollout.calculator import Calculator, evaluate_expression, format_number
from workers.rollout.chat_messages import MessageFormatError, check_messages
from workers.rollout.rewards import Reward, Transcript, check_ground_truth, get_reward
from workers.rollout.tools import ToolRegistry, function_schema, validate_tool_schema

__all__ = [
    "DIGITS_TASK",
    "Task",
    "TaskFormatError",
    "MAX_BUILTIN_INDEX",
    "arithmetic_tasks",
    "builtin_task",
    "calc_tasks",
    "function_call_tasks",
    "load_tasks",
    "resolve_task",
    "task_from_dict",
]

_FIELDS = ("task_id", "messages", "tools", "ground_truth", "reward", "max_turns",
           "stop_at_tool_calls")


class TaskFormatError(ValueError):
    """A task definition is invalid; the message names where (file and line) and the field."""


@dataclass(frozen=True)
class Task:
    """One task. ``tools`` are OpenAI function schemas; ``reward`` names a registered reward
    function; ``max_turns`` (optional) overrides the loop's limit; with ``stop_at_tool_calls``
    the episode ends at the first well-formed tool calls, which are not executed."""

    task_id: str
    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...]
    ground_truth: Any
    reward: str
    max_turns: int | None = None
    stop_at_tool_calls: bool = False

    def score(self, transcript: Transcript) -> Reward | None:
        """Apply the task's reward function to ``transcript`` (None: the task is scored
        elsewhere, ``unscored``)."""
        return get_reward(self.reward)(self.ground_truth, transcript)

    def to_dict(self) -> dict[str, Any]:
        """The task as a JSON-ready dict (the JSONL line format)."""
        return {"task_id": self.task_id, "messages": [dict(m) for m in self.messages],
                "tools": [dict(t) for t in self.tools], "ground_truth": self.ground_truth,
                "reward": self.reward, "max_turns": self.max_turns,
                "stop_at_tool_calls": self.stop_at_tool_calls}


def _fail(where: str, field: str, problem: str) -> TaskFormatError:
    return TaskFormatError(f"{where}: field {field!r}: {problem}")


def _messages(value: Any, where: str) -> tuple[dict[str, Any], ...]:
    try:
        return check_messages(value, where=where)
    except MessageFormatError as exc:
        raise TaskFormatError(str(exc)) from None


def _tools(value: Any, where: str, registry: ToolRegistry | None) -> tuple[dict[str, Any], ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _fail(where, "tools", f"expected a list, got {value!r}")
    schemas: list[dict[str, Any]] = []
    for index, entry in enumerate(value):
        field = f"tools[{index}]"
        if isinstance(entry, str):
            if registry is None or entry not in registry:
                known = registry.names() if registry is not None else []
                raise _fail(where, field, f"unknown tool {entry!r}; known: {known}")
            schemas.append(registry.get(entry).schema)
        else:
            try:
                schemas.append(validate_tool_schema(entry, where=field))
            except ValueError as exc:
                raise TaskFormatError(f"{where}: {exc}") from None
    names = [s["function"]["name"] for s in schemas]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise _fail(where, "tools", f"tool names {duplicates} appear more than once")
    return tuple(schemas)


def task_from_dict(
    data: Any, *, where: str = "task", registry: ToolRegistry | None = None
) -> Task:
    """Build a :class:`Task` from one decoded task object (format in the module docstring).
    Raises TaskFormatError (a ValueError) naming ``where`` and the faulty field."""
    if not isinstance(data, Mapping):
        raise TaskFormatError(f"{where}: expected a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise _fail(where, unknown[0], f"unknown field; known fields: {list(_FIELDS)}")
    task_id = data.get("task_id")
    if not isinstance(task_id, str) or not task_id.strip():
        raise _fail(where, "task_id", f"expected a non-empty string, got {task_id!r}")
    messages = _messages(data.get("messages"), where)
    tools = _tools(data.get("tools"), where, registry)
    reward = data.get("reward")
    if not isinstance(reward, str):
        raise _fail(where, "reward", f"expected a reward name, got {reward!r}")
    if "ground_truth" not in data:
        raise _fail(where, "ground_truth", "is required")
    try:
        check_ground_truth(reward, data["ground_truth"])
    except ValueError as exc:
        field = "reward" if str(exc).startswith("unknown reward") else "ground_truth"
        raise _fail(where, field, str(exc)) from None
    max_turns = data.get("max_turns")
    if max_turns is not None and (isinstance(max_turns, bool) or not isinstance(max_turns, int)
                                  or max_turns < 1):
        raise _fail(where, "max_turns", f"expected a positive integer, got {max_turns!r}")
    stop = data.get("stop_at_tool_calls", False)
    if not isinstance(stop, bool):
        raise _fail(where, "stop_at_tool_calls", f"expected true or false, got {stop!r}")
    return Task(task_id=task_id, messages=messages, tools=tools,
                ground_truth=data["ground_truth"], reward=reward, max_turns=max_turns,
                stop_at_tool_calls=stop)


def load_tasks(path: str | os.PathLike[str], *, registry: ToolRegistry | None = None
               ) -> list[Task]:
    """Read tasks from a JSONL file (format in the module docstring).

    Tool names resolve in ``registry`` (the built-in calculator and python tools when None).
    Raises FileNotFoundError for a missing file and TaskFormatError naming the line and field
    for invalid JSON, invalid fields, a repeated ``task_id`` or an empty file.
    """
    file = Path(path)
    if registry is None:
        registry = default_tool_registry()
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    with file.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            where = f"{file.name} line {number}"
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise TaskFormatError(f"{where}: invalid JSON: {exc.msg} at column {exc.colno}"
                                      ) from None
            task = task_from_dict(data, where=where, registry=registry)
            if task.task_id in seen:
                raise _fail(where, "task_id", f"{task.task_id!r} already used on line "
                                              f"{seen[task.task_id]}")
            seen[task.task_id] = number
            tasks.append(task)
    if not tasks:
        raise TaskFormatError(f"{file.name}: no tasks in the file")
    return tasks


_ARITHMETIC_SYSTEM = ("You are a careful assistant. Use the calculator tool for arithmetic, "
                      "then state the final answer as a number.")


def arithmetic_tasks(count: int, *, seed: int = 0) -> list[Task]:
    """``count`` generated arithmetic questions (two operators, small integers) whose answer
    needs the calculator; reward ``final_answer``, at most 4 turns. Deterministic in ``seed``.
    Raises ValueError when ``count`` is not a positive integer."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be a positive integer, got {count!r}")
    rng = random.Random(seed)
    tasks = []
    for index in range(count):
        a, b, c = rng.randint(10, 999), rng.randint(2, 99), rng.randint(1, 500)
        expression = f"{a} {rng.choice(['*', '+', '-'])} {b} {rng.choice(['+', '-'])} {c}"
        answer = format_number(evaluate_expression(expression))
        tasks.append(Task(
            task_id=f"arith-{seed}-{index}",
            messages=({"role": "system", "content": _ARITHMETIC_SYSTEM},
                      {"role": "user", "content": f"What is {expression}?"}),
            tools=(Calculator.schema,),
            ground_truth=answer,
            reward="final_answer",
            max_turns=4,
        ))
    return tasks


CALC_SYSTEM = ("Answer with <think>reasoning</think> then one <tool_call> to the python or "
               "calculator tool; after its result, give <think>…</think> and the number.")


def calc_question(seed: int, index: int) -> tuple[str, str]:
    """The ``index``-th question of the ``calc`` set for ``seed`` and its expression: two
    small integers and one operator, in parentheses (``What is (19 * 34)?``).
    Deterministic in ``(seed, index)``.

    The parentheses make the expression the same tokens in the question and in a tool call
    (``print(19 * 34)`` ends with the question's ``(19 * 34)``), as a model's byte-level
    tokenizer would see ``19`` after ``(`` in both places; without them the question's
    `` 19`` (with its space) and the code's ``19`` are different tokens, and a small model
    must learn a mapping for every number instead of copying."""
    rng = random.Random(f"calc-{seed}-{index}")
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    op = rng.choice(["+", "-", "*"])
    expression = f"({a} {op} {b})"
    return f"What is {expression}?", expression


def calc_task(seed: int, index: int) -> Task:
    """The task ``calc-<seed>-<index>`` (see :func:`calc_tasks`)."""
    question, expression = calc_question(seed, index)
    from workers.rollout.sandbox import PythonTool

    return Task(
        task_id=f"calc-{seed}-{index}",
        messages=({"role": "system", "content": CALC_SYSTEM},
                  {"role": "user", "content": question}),
        tools=(PythonTool.schema, Calculator.schema),
        ground_truth=format_number(evaluate_expression(expression)),
        reward="tool_answer",
        max_turns=3,
    )


def calc_tasks(count: int, *, seed: int = 0) -> list[Task]:
    """``count`` generated tool-use questions (``What is (37 * 12)?``) with the ``python`` and
    ``calculator`` tools and the strict binary ``tool_answer`` reward, at most 3 turns.
    Deterministic in ``seed``. Raises ValueError when ``count`` is not a positive integer."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be a positive integer, got {count!r}")
    return [calc_task(seed, index) for index in range(count)]


_WEATHER = function_schema(
    "get_weather", description="Current weather for a city.",
    properties={"city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    required=["city", "unit"],
)
_CONVERT = function_schema(
    "convert_currency", description="Convert an amount of money between currencies.",
    properties={"amount": {"type": "number"}, "source": {"type": "string"},
                "target": {"type": "string"}},
    required=["amount", "source", "target"],
)
_CITIES = ("Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Austin", "Hanoi", "Perth")
_CURRENCIES = ("EUR", "USD", "JPY", "GBP", "CHF")


def function_call_tasks(count: int, *, seed: int = 0) -> list[Task]:
    """``count`` generated single-turn function-calling tasks (weather, currency conversion)
    with EGPO's binary ``function_call`` reward; the call is the answer
    (``stop_at_tool_calls``). Deterministic in ``seed``. Raises ValueError when ``count`` is
    not a positive integer."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be a positive integer, got {count!r}")
    rng = random.Random(seed)
    tasks = []
    for index in range(count):
        if index % 2 == 0:
            city, unit = rng.choice(_CITIES), rng.choice(["celsius", "fahrenheit"])
            question = f"What is the weather in {city} right now, in {unit}?"
            truth = {"name": "get_weather", "arguments": {"city": city, "unit": unit}}
        else:
            amount = rng.randint(1, 5000)
            source, target = rng.sample(_CURRENCIES, 2)
            question = f"How much is {amount} {source} in {target}?"
            truth = {"name": "convert_currency",
                     "arguments": {"amount": amount, "source": source, "target": target}}
        tasks.append(Task(
            task_id=f"fc-{seed}-{index}",
            messages=({"role": "user", "content": question},),
            tools=(_WEATHER, _CONVERT),
            ground_truth=[truth],
            reward="function_call",
            max_turns=1,
            stop_at_tool_calls=True,
        ))
    return tasks


#: Largest ``<index>`` of a built-in task id (the set is generated up to it).
MAX_BUILTIN_INDEX = 99_999
_BUILTIN_ID = re.compile(r"^(arith|fc|calc)-(\d+)-(\d+)$")


#: The demo's task: write digits (reward ``digit_share``), with the calculator on offer, so
#: that a tiny untrained model measurably learns within minutes on a CPU while its stray tool
#: calls exercise tool errors, rollbacks and negative samples.
DIGITS_TASK = Task(
    task_id="digits",
    messages=({"role": "user", "content": "Write digits only."},),
    tools=(Calculator.schema,),
    ground_truth=None,
    reward="digit_share",
    max_turns=2,
)


def builtin_task(task_id: str) -> Task | None:
    """The built-in task ``digits``, ``arith-``, ``fc-`` or ``calc-<seed>-<index>``, or
    None when ``task_id`` has none of these forms. Raises ValueError for an index above
    :data:`MAX_BUILTIN_INDEX`."""
    if task_id == DIGITS_TASK.task_id:
        return DIGITS_TASK
    match = _BUILTIN_ID.match(task_id) if isinstance(task_id, str) else None
    if match is None:
        return None
    kind, seed, index = match.group(1), int(match.group(2)), int(match.group(3))
    if index > MAX_BUILTIN_INDEX:
        raise ValueError(f"task id {task_id!r}: index {index} is above {MAX_BUILTIN_INDEX}")
    if kind == "calc":
        return calc_task(seed, index)
    generate = arithmetic_tasks if kind == "arith" else function_call_tasks
    return generate(index + 1, seed=seed)[index]


def resolve_task(task_id: str, *, tasks_dir: str | os.PathLike[str] | None = None,
                 registry: ToolRegistry | None = None) -> Task:
    """The task ``task_id``: a built-in one (:func:`builtin_task`), else the task of that id
    in the ``*.jsonl`` files of ``tasks_dir`` (read in name order; tool names resolve in
    ``registry``). Raises ValueError naming the id when no task has it, and TaskFormatError
    for an invalid file."""
    if not isinstance(task_id, str) or not task_id:
        raise ValueError(f"task_id must be a non-empty string, got {task_id!r}")
    task = builtin_task(task_id)
    if task is not None:
        return task
    folder = Path(tasks_dir) if tasks_dir is not None else None
    if folder is not None and folder.is_dir():
        for path in sorted(folder.glob("*.jsonl")):
            for candidate in load_tasks(path, registry=registry):
                if candidate.task_id == task_id:
                    return candidate
    raise ValueError(f"unknown task_id {task_id!r}: not a built-in id (digits, "
                     f"arith-<seed>-<index>, calc-<seed>-<index>, "
                     f"fc-<seed>-<index>) nor in the JSONL files of {folder}")
