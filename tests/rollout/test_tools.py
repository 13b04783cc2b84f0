"""The tool registry: schemas, duplicate names, unknown tools and argument checks."""

from __future__ import annotations

from typing import Any

import pytest

from workers.rollout.builtin_tools import default_tool_registry
from workers.rollout.calculator import Calculator
from workers.rollout.tools import (
    ToolOutcome,
    ToolRegistry,
    check_arguments,
    function_schema,
    validate_tool_schema,
)


class Echo:
    """A small real tool: returns its text argument, fails on an empty one."""

    name = "echo"
    schema = function_schema("echo", description="Repeat text.",
                             properties={"text": {"type": "string"},
                                         "times": {"type": "integer"}},
                             required=["text"])

    def __call__(self, arguments: dict[str, Any]) -> ToolOutcome:
        if not arguments["text"]:
            raise RuntimeError("nothing to echo")
        return ToolOutcome(output=arguments["text"] * arguments.get("times", 1))


def test_default_registry_holds_calculator_and_python() -> None:
    registry = default_tool_registry()
    assert registry.names() == ["calculator", "python"]
    assert [s["function"]["name"] for s in registry.schemas()] == ["calculator", "python"]
    assert registry.call("calculator", {"expression": "2*21"}).output == "42"


def test_call_turns_problems_into_error_outcomes() -> None:
    registry = ToolRegistry([Echo()])
    assert registry.call("echo", {"text": "ab", "times": 2}).output == "abab"
    missing = registry.call("nope", {})
    assert missing.error_type == "ToolNotFoundError" and "'nope'" in missing.error_message
    assert registry.call("echo", {}).error_type == "ToolArgumentError"
    wrong = registry.call("echo", {"text": "a", "times": "2"})
    assert wrong.error_type == "ToolArgumentError" and "'times'" in wrong.error_message
    crashed = registry.call("echo", {"text": ""})
    assert crashed.error_type == "RuntimeError"
    assert crashed.output == "RuntimeError: nothing to echo"


def test_registry_refuses_duplicates_and_bad_schemas() -> None:
    registry = ToolRegistry([Calculator()])
    with pytest.raises(ValueError, match="already registered"):
        registry.register(Calculator())
    with pytest.raises(ValueError, match="unknown tool 'x'"):
        registry.get("x")
    broken = Echo()
    broken.schema = {"type": "function", "function": {"name": "other"}}
    with pytest.raises(ValueError, match="schema name 'other'"):
        ToolRegistry([broken])


def test_schema_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="field 'type'"):
        validate_tool_schema({"type": "tool"})
    with pytest.raises(ValueError, match="field 'function.name'"):
        validate_tool_schema({"type": "function", "function": {"name": ""}})
    with pytest.raises(ValueError, match="field 'function.parameters'"):
        validate_tool_schema({"type": "function", "function": {"name": "a", "parameters": 1}})
    with pytest.raises(ValueError, match="not declared"):
        function_schema("a", description="", properties={}, required=["x"])


def test_argument_checks() -> None:
    schema = function_schema("f", description="",
                             properties={"n": {"type": "number"}, "flag": {"type": "boolean"}},
                             required=["n"])
    assert check_arguments(schema, {"n": 2.5, "flag": True}) is None
    assert "must be of type number" in check_arguments(schema, {"n": True})
    assert "missing required" in check_arguments(schema, {"flag": False})
    closed = function_schema("g", description="", properties={"a": {"type": "string"}})
    closed["function"]["parameters"]["additionalProperties"] = False
    assert "unexpected argument 'b'" in check_arguments(closed, {"b": 1})
