"""Builders of scripted assistant turns (text the replay backend forces through the model)."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["tool_call", "turn"]


def tool_call(name: str, **arguments: Any) -> str:
    """A well-formed Qwen-style tool-call block."""
    payload = json.dumps({"name": name, "arguments": arguments})
    return f"<tool_call>\n{payload}\n</tool_call>"


def turn(reasoning: str, *calls: str) -> str:
    """An assistant turn: a think block followed by tool-call blocks."""
    return f"<think>\n{reasoning}\n</think>\n\n" + "\n".join(calls)
