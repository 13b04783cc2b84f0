"""Running the agent's tool calls without blocking the event loop of the agent loop.

A :class:`ToolRunner` runs synchronous tools (the calculator, the Python sandbox, a user's
function) on a bounded pool of threads: the pool's size is the most tool calls in flight, so
with the sandbox it is also the most sandbox processes alive at once, each under the
sandbox's own limits (it kills its process at its wall-clock limit). A tool that has an
``acall(arguments)`` coroutine (an I/O tool: an HTTP call, a database query) is awaited on the
event loop instead.

Every call has a deadline, ``timeout_s``: a call still running then is recorded as a
``TimeoutError`` outcome and the episode goes on. The sandbox's own limit is lower, so this
deadline is the backstop for tools that have none; a synchronous tool past it keeps its
thread until it returns (Python cannot kill a thread), which is why the pool is bounded and
its size is a setting.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading
from collections.abc import Mapping
from typing import Any

from store.arguments import whole_number
from workers.rollout.tools import ToolOutcome, ToolRegistry

__all__ = ["TOOL_TIMEOUT_ERROR", "ToolRunner", "default_tool_runner"]

TOOL_TIMEOUT_ERROR = "TimeoutError"

_lock = threading.Lock()
_default: ToolRunner | None = None


class ToolRunner:
    """Runs tool calls for concurrent episodes (module docstring).

    ``workers`` threads for synchronous tools (>= 1), ``timeout_s`` the deadline of one call
    (> 0, finite). Bad values raise ValueError naming the argument.
    """

    def __init__(self, *, workers: int = 4, timeout_s: float = 60.0) -> None:
        whole_number("workers", workers)
        if (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                or not math.isfinite(timeout_s) or timeout_s <= 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self.workers = workers
        self.timeout_s = float(timeout_s)
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="tool")

    async def call(self, registry: ToolRegistry, name: str,
                   arguments: Mapping[str, Any]) -> ToolOutcome:
        """Call tool ``name`` of ``registry``. Never raises for the tool's sake: unknown tools,
        bad arguments, escaped exceptions and calls past ``timeout_s`` come back as error
        outcomes (``ToolNotFoundError``, ``ToolArgumentError``, the exception's type name,
        ``TimeoutError``)."""
        refused = registry.refusal(name, arguments)
        if refused is not None:
            return refused
        tool = registry.get(name)
        acall = getattr(tool, "acall", None)
        if acall is not None:
            pending: Any = acall(dict(arguments))
        else:
            pending = asyncio.get_running_loop().run_in_executor(
                self._pool, registry.call, name, dict(arguments))
        try:
            outcome = await asyncio.wait_for(pending, self.timeout_s)
        except TimeoutError:
            return ToolOutcome.error(TOOL_TIMEOUT_ERROR, f"tool {name!r} did not return within "
                                     f"{self.timeout_s:g} s")
        except Exception as exc:  # an async tool's bug must not kill the episode
            return ToolOutcome.error(type(exc).__name__, str(exc))
        if not isinstance(outcome, ToolOutcome):
            return ToolOutcome.error("TypeError", f"tool {name!r} returned "
                                     f"{type(outcome).__name__}, not a ToolOutcome")
        return outcome

    def close(self) -> None:
        """Stop taking calls; threads still running finish in the background."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def default_tool_runner() -> ToolRunner:
    """The process's runner, sized by the settings ``rollout_tool_workers`` and
    ``rollout_tool_timeout_s`` (made on first use)."""
    global _default
    with _lock:
        if _default is None:
            from store.settings import get_settings

            settings = get_settings()
            _default = ToolRunner(workers=settings.rollout_tool_workers,
                                  timeout_s=settings.rollout_tool_timeout_s)
        return _default
