"""One LLM call, one event id, whichever door it is recorded through.

An agent whose ``openai`` client is instrumented with OpenTelemetry and calls the capture
gateway is seen twice: the gateway records the call it answers, and the client's span,
exported to ``/v1/traces``, describes the same call. Both know the id of the answer (the
``id`` of an OpenAI-compatible response: ``chatcmpl-…``), which the span carries as
``gen_ai.response.id`` (OpenInference: the ``id`` of its JSON ``output.value``). So the
``llm_called`` of a call the client got an answer to takes its event id from that answer id,
on both doors, and the log, which never stores an event id twice, holds the call once.
"""

from __future__ import annotations

import uuid

__all__ = ["CALL_NAMESPACE", "call_event_id"]

#: The namespace of the uuid5 ids ``call_event_id`` derives.
CALL_NAMESPACE = uuid.UUID("0c6f7a1e-2b9d-5e44-8a31-6d2f9b0e4c75")


def call_event_id(response_id: str) -> uuid.UUID:
    """The ``llm_called`` event id of the call answered with ``response_id`` (module
    docstring). Raises ValueError for an empty or non-string id."""
    if not isinstance(response_id, str) or not response_id:
        raise ValueError(f"response_id must be a non-empty string, got {response_id!r}")
    return uuid.uuid5(CALL_NAMESPACE, response_id)
