"""Tools an agent can call: the :class:`Tool` seam, its outcome and a name registry.

A tool has a ``name``, an OpenAI function ``schema`` (``{"type": "function", "function":
{"name", "description", "parameters"}}``) and is called with the decoded arguments dict. It
never raises for a bad call: errors come back as a :class:`ToolOutcome` with ``is_error`` set and
``error_type`` the Python exception type name (``NameError``, ``ZeroDivisionError``…) or one of
this module's names (``ToolNotFoundError``, ``ToolArgumentError``), which is what rollback
patterns match on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from store.validation import storable_text

__all__ = [
    "TOOL_ARGUMENT_ERROR",
    "TOOL_NOT_FOUND_ERROR",
    "Tool",
    "ToolOutcome",
    "ToolRegistry",
    "check_arguments",
    "function_schema",
    "validate_tool_schema",
]

TOOL_NOT_FOUND_ERROR = "ToolNotFoundError"
TOOL_ARGUMENT_ERROR = "ToolArgumentError"

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


@dataclass(frozen=True)
class ToolOutcome:
    """The result of one tool call: ``output`` is the text the model sees."""

    output: str
    is_error: bool = False
    error_type: str | None = None
    error_message: str | None = None

    def __post_init__(self) -> None:
        # A tool may print anything; what the store refuses is replaced (storable_text).
        object.__setattr__(self, "output", storable_text(self.output))
        if self.error_message is not None:
            object.__setattr__(self, "error_message", storable_text(self.error_message))

    @classmethod
    def error(cls, error_type: str, message: str, *, output: str | None = None) -> ToolOutcome:
        """An error outcome whose output defaults to ``"<error_type>: <message>"``."""
        text = output if output is not None else f"{error_type}: {message}"
        return cls(output=text, is_error=True, error_type=error_type, error_message=message)


@runtime_checkable
class Tool(Protocol):
    """A callable tool with a name and an OpenAI function schema. A tool may also have an
    ``idempotent`` attribute (False when absent): True lets a run of it that was interrupted
    (its worker died before the result was stored) run again when the episode resumes;
    otherwise that call's result is an interrupted-tool error."""

    name: str
    schema: dict[str, Any]

    def __call__(self, arguments: dict[str, Any]) -> ToolOutcome:
        """Run the tool; report failures in the outcome, never by raising."""
        ...


def function_schema(name: str, *, description: str, properties: Mapping[str, Any],
                    required: Iterable[str] = ()) -> dict[str, Any]:
    """Build an OpenAI function schema; raises ValueError for an empty name or a required
    property that is not declared."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    required = list(required)
    missing = [key for key in required if key not in properties]
    if missing:
        raise ValueError(f"required properties {missing} are not declared in properties")
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": dict(properties),
                           "required": required},
        },
    }


def validate_tool_schema(schema: Any, *, where: str = "tool") -> dict[str, Any]:
    """Check that ``schema`` is an OpenAI function schema and return it.

    Raises ValueError naming ``where`` and the faulty field when ``type`` is not "function",
    ``function.name`` is not a non-empty string or ``function.parameters`` is not an object.
    """
    if not isinstance(schema, Mapping):
        raise ValueError(f"{where}: expected an object, got {type(schema).__name__}")
    if schema.get("type") != "function":
        raise ValueError(f"{where}: field 'type' must be 'function', got {schema.get('type')!r}")
    function = schema.get("function")
    if not isinstance(function, Mapping):
        raise ValueError(f"{where}: field 'function' must be an object, got {function!r}")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: field 'function.name' must be a non-empty string, "
                         f"got {name!r}")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, Mapping):
        raise ValueError(f"{where}: field 'function.parameters' must be an object, "
                         f"got {parameters!r}")
    return dict(schema)


def check_arguments(schema: Mapping[str, Any], arguments: Mapping[str, Any]) -> str | None:
    """Check ``arguments`` against the schema's top-level ``required`` list and the declared
    JSON types of its properties; return a message describing the first problem, or None."""
    parameters = schema.get("function", {}).get("parameters", {}) or {}
    properties = parameters.get("properties", {}) or {}
    for key in parameters.get("required", []) or []:
        if key not in arguments:
            return f"missing required argument {key!r}"
    for key, value in arguments.items():
        spec = properties.get(key)
        if spec is None:
            if parameters.get("additionalProperties", True) is False:
                return f"unexpected argument {key!r}"
            continue
        expected = spec.get("type") if isinstance(spec, Mapping) else None
        types = _JSON_TYPES.get(expected) if isinstance(expected, str) else None
        if types is None:
            continue
        wrong_bool = isinstance(value, bool) and expected in ("integer", "number")
        if wrong_bool or not isinstance(value, types):
            return f"argument {key!r} must be of type {expected}, got {type(value).__name__}"
    return None


class ToolRegistry:
    """Tools by name. ``register`` refuses a name registered twice; ``call`` turns an unknown
    name or arguments that do not fit the schema into error outcomes."""

    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            self.register(tool)

    def register(self, tool: Tool) -> Tool:
        """Add ``tool``; raises ValueError when its name is taken or its schema is invalid."""
        validate_tool_schema(tool.schema, where=f"tool {tool.name!r}")
        if tool.schema["function"]["name"] != tool.name:
            raise ValueError(f"tool {tool.name!r} has schema name "
                             f"{tool.schema['function']['name']!r}; they must be equal")
        if tool.name in self._tools:
            raise ValueError(f"tool {tool.name!r} is already registered")
        self._tools[tool.name] = tool
        return tool

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def names(self) -> list[str]:
        """Registered names in registration order."""
        return list(self._tools)

    def get(self, name: str) -> Tool:
        """The tool called ``name``; raises ValueError listing the known names otherwise."""
        try:
            return self._tools[name]
        except KeyError:
            raise ValueError(f"unknown tool {name!r}; known: {self.names()}") from None

    def schemas(self, names: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """OpenAI schemas of ``names`` (all tools when None); unknown names raise ValueError."""
        chosen = self.names() if names is None else list(names)
        return [self.get(name).schema for name in chosen]

    def idempotent(self, name: str) -> bool:
        """Whether tool ``name`` may run again after a run of it was interrupted (its
        ``idempotent`` attribute; False when it has none, or for an unknown name)."""
        return bool(getattr(self._tools.get(name), "idempotent", False))

    def refusal(self, name: str, arguments: Mapping[str, Any]) -> ToolOutcome | None:
        """The error outcome of a call that must not run (an unknown tool, type name
        ``ToolNotFoundError``, or arguments that do not fit its schema,
        ``ToolArgumentError``); None when the call may run."""
        tool = self._tools.get(name)
        if tool is None:
            return ToolOutcome.error(TOOL_NOT_FOUND_ERROR,
                                     f"no tool named {name!r}; available: {self.names()}")
        problem = check_arguments(tool.schema, arguments)
        if problem is not None:
            return ToolOutcome.error(TOOL_ARGUMENT_ERROR, f"{name}: {problem}")
        return None

    def call(self, name: str, arguments: Mapping[str, Any]) -> ToolOutcome:
        """Call tool ``name``; unknown tools, bad arguments and exceptions the tool lets escape
        come back as error outcomes (type names ``ToolNotFoundError``, ``ToolArgumentError``,
        or the escaped exception's type)."""
        refused = self.refusal(name, arguments)
        if refused is not None:
            return refused
        tool = self._tools[name]
        try:
            return tool(dict(arguments))
        except Exception as exc:  # a tool bug must not kill the episode
            return ToolOutcome.error(type(exc).__name__, str(exc))
