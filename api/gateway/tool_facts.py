"""Facts a gateway call's history tells about the agent's own steps between calls.

**Tool results.** An agent that calls tools runs them between two LLM calls and sends their
results back as ``tool`` messages answering the assistant message's ``tool_calls``. Each such
result becomes one ``tool_returned`` event (tool call id, the call's name and arguments, the
output), appended before the ``llm_called`` of the request that first carries it and never
again for the same tool call id (its event id is derived from episode and tool call id, as an
``execute_tool`` span of the same call derives it, ``api.call_ids.tool_event_id``, and ids
already stored are skipped; an id a client issues again in a later turn is a new call, with an
id derived from episode, agent, tool call id and its issue). A tool message is matched to
the call its ``tool_call_id`` names among the preceding assistant messages' calls; without
one, to the next unanswered call of the assistant message before it. Tool messages that
answer no call are not recorded. Arguments are the call's JSON ``arguments`` (text that is
not a JSON object is kept as ``{"raw": text}``).

**Errors** (``is_error``, ``error_type``, ``error_message``), decided from the output text:

- the last non-empty line is a Python exception line, ``XxxError: message`` or
  ``XxxException: message`` (a traceback's last line, module prefixes allowed:
  ``json.decoder.JSONDecodeError: …``); the type is the name without its module;
- or the output is a JSON object with a non-empty ``"error"``: its ``type`` (when the error
  is an object naming one) or ``ToolError``, and its ``message`` (or the error as text).

Anything else is a success.

**Abandoned attempts.** ``abandon_events`` marks an earlier call of the episode abandoned (a
client-side retry that threw its answer away): an ``attempt_failed`` naming the call
(error type ``Abandoned``) and a ``rolled_back`` discarding it, so that replay makes the
abandoned branch a negative sample (``save_negative_samples``) and never a positive one.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from api.call_ids import tool_event_id
from store.events import ABANDONED_ERROR_TYPE, AttemptFailed, Event, RolledBack, ToolReturned

__all__ = ["ABANDONED_TYPE", "abandon_events", "classify_output", "fact_id", "tool_results"]

#: ``error_types`` of the ``attempt_failed`` an abandoned call gets.
ABANDONED_TYPE = ABANDONED_ERROR_TYPE

_NAMESPACE = uuid.UUID("5b0f3c52-6d0e-4d61-9c2b-8f1f2f7c1a19")
_EXCEPTION_LINE = re.compile(
    r"^(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*(?:Error|Exception))(?::\s?(.*))?$")


def fact_id(episode_id: str, agent: str, kind: str, key: str) -> uuid.UUID:
    """The event id of a fact the gateway derives (the same for every request carrying it)."""
    return uuid.uuid5(_NAMESPACE, json.dumps([episode_id, agent, kind, key]))


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "".join(str(p.get("text", "")) for p in content
                       if isinstance(p, Mapping) and p.get("type", "text") == "text")
    return "" if content is None else json.dumps(content)


def classify_output(output: str) -> tuple[bool, str | None, str | None]:
    """``(is_error, error_type, error_message)`` of a tool's output (module docstring)."""
    stripped = output.strip()
    if stripped.startswith("{"):
        try:
            data = json.loads(stripped)
        except ValueError:
            data = None
        if isinstance(data, dict) and data.get("error") not in (None, False, "", {}, []):
            error = data["error"]
            if isinstance(error, Mapping):
                kind = error.get("type")
                message = error.get("message")
                return (True, str(kind) if isinstance(kind, str) and kind else "ToolError",
                        str(message) if message is not None else json.dumps(error))
            return True, "ToolError", error if isinstance(error, str) else json.dumps(error)
    lines = [line.strip() for line in stripped.splitlines() if line.strip()]
    if lines:
        match = _EXCEPTION_LINE.match(lines[-1])
        if match:
            return True, match.group(1), (match.group(2) or "").strip() or None
    return False, None, None


def _arguments(raw: Any) -> dict[str, Any]:
    if isinstance(raw, Mapping):
        return dict(raw)
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw) if raw.strip() else {}
        except ValueError:
            return {"raw": raw}
        return parsed if isinstance(parsed, dict) else {"raw": raw}
    return {} if raw is None else {"raw": json.dumps(raw)}


def tool_results(messages: Sequence[Mapping[str, Any]], *, episode_id: str, agent: str
                 ) -> list[ToolReturned]:
    """A ``tool_returned`` for every tool message of ``messages`` that answers a call of a
    preceding assistant message, in message order, with its derived event id."""
    calls: dict[str, tuple[str, str, dict[str, Any]]] = {}  # tool call id -> key, name, args
    seen: dict[str, int] = {}  # how often each tool call id was issued so far
    pending: list[tuple[str, str | None, str, dict[str, Any]]] = []  # last turn's, unanswered
    out: list[ToolReturned] = []
    for index, message in enumerate(messages):
        role = message.get("role")
        if role == "assistant":
            pending = []
            for k, call in enumerate(message.get("tool_calls") or []):
                if not isinstance(call, Mapping):
                    continue
                nested = call.get("function")
                function: Mapping[str, Any] = nested if isinstance(nested, Mapping) else call
                name = function.get("name")
                if not isinstance(name, str) or not name or len(name) > 200:
                    continue
                call_id = call.get("id")
                arguments = _arguments(function.get("arguments"))
                if isinstance(call_id, str) and call_id:
                    # A client that reuses ids across turns issues each one anew: the n-th
                    # issue of an id is its own fact.
                    n = seen.get(call_id, 0)
                    seen[call_id] = n + 1
                    key = call_id if n == 0 else f"{call_id}#{n}"
                    calls[call_id] = (key, name, arguments)
                else:
                    key, call_id = f"#{index}.{k}", None
                pending.append((key, call_id, name, arguments))
        elif role == "tool":
            wanted = message.get("tool_call_id")
            if isinstance(wanted, str) and wanted:
                if wanted not in calls:
                    continue
                key, name, arguments = calls.pop(wanted)
                raw: str | None = wanted
                pending = [p for p in pending if p[0] != key]
            elif pending:
                key, raw, name, arguments = pending.pop(0)
                if raw is not None:
                    calls.pop(raw, None)
            else:
                continue
            output = _text(message.get("content"))
            is_error, error_type, error_message = classify_output(output)
            # The first issue of a tool call id takes the id an execute_tool span of the same
            # call takes too (api.call_ids): one call, one fact.
            shared = raw is not None and key == raw
            out.append(ToolReturned(
                event_id=(tool_event_id(episode_id, raw) if shared and raw is not None
                          else fact_id(episode_id, agent, "tool", key)), agent=agent,
                tool_call_id=raw, name=name,
                arguments=arguments, output=output, is_error=is_error,
                error_type=error_type, error_message=error_message))
    return out


def abandon_events(episode_id: str, *, agent: str, call_id: str, turn: int, retry_index: int
                   ) -> list[Event]:
    """The ``attempt_failed`` and ``rolled_back`` that mark call ``call_id`` (made at
    assistant turn ``turn``) abandoned by the client."""
    checkpoint = f"abandoned:{call_id}"[:200]
    return [
        AttemptFailed(event_id=fact_id(episode_id, agent, "abandoned", call_id), agent=agent,
                      checkpoint_id=checkpoint, position_key=f"turn_{turn}",
                      retry_index=retry_index,
                      error_messages=["the client abandoned this attempt"],
                      error_types=[ABANDONED_TYPE], failed_call_id=call_id),
        RolledBack(event_id=fact_id(episode_id, agent, "rolled_back", call_id), agent=agent,
                   checkpoint_id=checkpoint, discarded_call_ids=[call_id]),
    ]
