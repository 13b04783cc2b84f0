"""Rollout: the agent loop with tool-call rollback, generation backends, tools, tasks, rewards.

The light-weight pieces are re-exported here. Backends that need torch or vLLM are imported
from their own modules: :mod:`workers.rollout.backend_transformers`,
:mod:`workers.rollout.backend_replay`, :mod:`workers.rollout.backend_vllm`,
:mod:`workers.rollout.backend_openai`, :mod:`workers.rollout.backend_remote`; the tiny test model
from :mod:`workers.rollout.tinymodel`. Groups of the rollout queue: :mod:`workers.rollout.group`
(Celery task in :mod:`workers.rollout.celery_tasks`); remote rollouts:
:mod:`workers.rollout.remote` (played on rollout workers), their request checks
:mod:`workers.rollout.remote_request` and their queueing :mod:`workers.rollout.remote_dispatch`
(both of which the API imports).
"""

from workers.rollout.agent_tasks import (
    Task,
    TaskFormatError,
    arithmetic_tasks,
    function_call_tasks,
    load_tasks,
)
from workers.rollout.backend import (
    GenerationBackend,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    WeightUpdatable,
)
from workers.rollout.builtin_tools import default_tool_registry
from workers.rollout.calculator import Calculator
from workers.rollout.loop import EpisodeResult, run_episode
from workers.rollout.rewards import Reward, Transcript, get_reward, register_reward
from workers.rollout.sandbox import PythonSandbox, PythonTool
from workers.rollout.sink import EventSink, ListSink
from workers.rollout.toolcall import TOOL_CALL_FORMAT_ERROR, parse_response
from workers.rollout.tools import Tool, ToolOutcome, ToolRegistry

__all__ = [
    "TOOL_CALL_FORMAT_ERROR",
    "Calculator",
    "EpisodeResult",
    "EventSink",
    "GenerationBackend",
    "GenerationRequest",
    "GenerationResult",
    "ListSink",
    "PythonSandbox",
    "PythonTool",
    "Reward",
    "SamplingParams",
    "Task",
    "TaskFormatError",
    "Tool",
    "ToolOutcome",
    "ToolRegistry",
    "Transcript",
    "WeightUpdatable",
    "arithmetic_tasks",
    "default_tool_registry",
    "function_call_tasks",
    "get_reward",
    "load_tasks",
    "parse_response",
    "register_reward",
    "run_episode",
]
