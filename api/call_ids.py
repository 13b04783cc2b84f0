"""One LLM call, one tool call: one event id each, whichever door records it.

An agent whose ``openai`` client is instrumented with OpenTelemetry and calls the capture
gateway is seen twice: the gateway records the call it answers, and the client's span,
exported to ``/v1/traces``, describes the same call. Both know the id of the answer (the
``id`` of an OpenAI-compatible response: ``chatcmpl-…``), which the span carries as
``gen_ai.response.id`` (OpenInference: the ``id`` of its JSON ``output.value``). So the
``llm_called`` of a call the client got an answer to takes its event id from that answer id,
on both doors, and the log, which never stores an event id twice, holds the call once.

A tool call is seen twice the same way: the gateway derives a ``tool_returned`` from the
``tool`` message that answers it in the next request, and the agent's ``execute_tool`` span
reports it to ``/v1/traces``. Both know the episode and the tool call id the model issued, so
both take ``tool_event_id(episode, tool call id)`` and the second report is left out as stored
before. An id a client issues again within one episode names a new call: the gateway counts
the issues and gives every later one an id of its own (``api.gateway.tool_facts``), and a
span whose shared id holds a call of another tool or other arguments keeps an id of its own
(``api.otlp.ingest``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

__all__ = ["CALL_NAMESPACE", "TOOL_NAMESPACE", "call_event_id", "same_tool_call",
           "tool_event_id"]

#: The namespace of the uuid5 ids ``call_event_id`` derives.
CALL_NAMESPACE = uuid.UUID("0c6f7a1e-2b9d-5e44-8a31-6d2f9b0e4c75")

#: The namespace of the uuid5 ids ``tool_event_id`` derives.
TOOL_NAMESPACE = uuid.UUID("7d1f0b6a-53c2-5f8e-9b47-2e6a1c3d8f90")


def call_event_id(response_id: str) -> uuid.UUID:
    """The ``llm_called`` event id of the call answered with ``response_id`` (module
    docstring). Raises ValueError for an empty or non-string id."""
    if not isinstance(response_id, str) or not response_id:
        raise ValueError(f"response_id must be a non-empty string, got {response_id!r}")
    return uuid.uuid5(CALL_NAMESPACE, response_id)


def tool_event_id(episode_id: str, tool_call_id: str) -> uuid.UUID:
    """The ``tool_returned`` event id of the first call the model issued as
    ``tool_call_id`` in ``episode_id`` (module docstring). Raises ValueError for an empty or
    non-string id."""
    for name, value in (("episode_id", episode_id), ("tool_call_id", tool_call_id)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    return uuid.uuid5(TOOL_NAMESPACE, json.dumps([episode_id, tool_call_id]))


def _arguments_key(arguments: Mapping[str, Any]) -> str:
    # Text that is no JSON object is kept whole by both doors, under "raw" (the gateway) or
    # "input" (a span): the same call either way.
    if len(arguments) == 1 and set(arguments) <= {"raw", "input"}:
        arguments = {"raw": next(iter(arguments.values()))}
    return json.dumps(arguments, sort_keys=True, default=str)


def same_tool_call(a: tuple[str, Mapping[str, Any]], b: tuple[str, Mapping[str, Any]]
                   ) -> bool:
    """Whether two reports ``(tool name, arguments)`` under one tool call id describe the
    same call (module docstring)."""
    return a[0] == b[0] and _arguments_key(a[1]) == _arguments_key(b[1])
