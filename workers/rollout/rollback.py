"""The rollback policy of the agent loop: which tool errors roll back, and the feedback text.

The configuration is the run's :class:`store.events.RollbackConfig` (``enable_tool_rollback``,
``max_tool_retries`` per position ``turn_N``, ``rollback_on_errors``, ``save_negative_samples``).
A tool outcome matches when it is an error and a pattern equals its ``error_type`` or occurs
in its output text (so ``"tool call format is wrong"`` matches the format-error feedback and
``"NameError"`` matches a traceback). Successful outputs never match, even if they print an
error name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from store.events import RollbackConfig, RunConfig
from workers.rollout.tools import ToolOutcome

__all__ = ["format_error_feedback", "matches_rollback", "rollback_config"]


def rollback_config(config: RollbackConfig | RunConfig | Mapping[str, Any] | None
                    ) -> RollbackConfig:
    """The rollback configuration from a run config, a rollback config, a plain dict of its
    fields or None (defaults). Raises ValueError (pydantic's) for invalid fields and TypeError
    for other types."""
    if config is None:
        return RollbackConfig()
    if isinstance(config, RunConfig):
        return config.rollback
    if isinstance(config, RollbackConfig):
        return config
    if isinstance(config, Mapping):
        return RollbackConfig.model_validate(dict(config))
    raise TypeError(f"rollback config must be a RollbackConfig, RunConfig or dict, "
                    f"got {type(config).__name__}")


def matches_rollback(outcome: ToolOutcome, patterns: Sequence[str]) -> bool:
    """True when ``outcome`` is an error matched by one of ``patterns`` (module docstring)."""
    if not outcome.is_error:
        return False
    return any(pattern == outcome.error_type or pattern in outcome.output
               for pattern in patterns)


def format_error_feedback(error_messages: Sequence[str]) -> str:
    """The user message that shows the model why its tool calls failed and asks for new ones.
    Raises ValueError when ``error_messages`` is empty."""
    if not error_messages:
        raise ValueError("error_messages must not be empty")
    listed = "\n".join(f"{index}. {message.strip()}"
                       for index, message in enumerate(error_messages, start=1))
    return ("The previous tool call(s) failed with the following error(s):\n"
            f"{listed}\n"
            "Fix the error(s) and make the tool call(s) again.")
