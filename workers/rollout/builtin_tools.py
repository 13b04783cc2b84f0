"""The registry of the tools that ship with the rollout worker: ``calculator`` and ``python``."""

from __future__ import annotations

from workers.rollout.calculator import Calculator
from workers.rollout.sandbox import PythonSandbox, PythonTool
from workers.rollout.tools import ToolRegistry

__all__ = ["default_tool_registry"]


def default_tool_registry(*, sandbox: PythonSandbox | None = None) -> ToolRegistry:
    """A new registry holding :class:`Calculator` and a :class:`PythonTool` running in
    ``sandbox`` (default limits when None). Raises TypeError when ``sandbox`` is not a
    PythonSandbox."""
    if sandbox is not None and not isinstance(sandbox, PythonSandbox):
        raise TypeError(f"sandbox must be a PythonSandbox, got {type(sandbox).__name__}")
    return ToolRegistry([Calculator(), PythonTool(sandbox)])
