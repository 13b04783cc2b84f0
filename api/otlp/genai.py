"""Spans of the OpenTelemetry GenAI semantic conventions (and OpenInference's, and the older
OpenLLMetry attributes) as trajstore events, one list per episode.

Pure: spans in, events out, no I/O. ``docs/otlp.md`` has the full table; in short:

- the episode is ``trajstore.episode_id``, else ``gen_ai.conversation.id`` (OpenInference:
  ``session.id``) of the span, of its nearest ancestor in the export that has one, or of
  any span of its trace; else the trace id. The agent is ``gen_ai.agent.name`` (or
  ``agent.name``), inherited the same way; else ``main``.
- ``gen_ai.operation.name`` ``chat``/``text_completion``/``generate_content`` (OpenInference
  ``LLM``) → ``llm_called``: request messages from ``gen_ai.input.messages`` (and
  ``gen_ai.system_instructions``), the answer from ``gen_ai.output.messages``, or the same
  from the span events of the older convention, or from ``gen_ai.prompt.N.*`` /
  ``gen_ai.completion.N.*``, or OpenInference's ``llm.input_messages.N.message.*``. Token
  ids, logprobs and the policy version come from ``prompt_token_ids``,
  ``response_token_ids`` (Agent Lightning's names), ``trajstore.logprobs`` and
  ``trajstore.policy_version``; a call without them is stored with empty token arrays.
- ``execute_tool`` (OpenInference ``TOOL``) → ``tool_returned``; a span with status ERROR or
  an ``error.type`` is a failed call.
- the root ``invoke_agent`` span (OpenInference ``AGENT``; one with no parent) →
  ``episode_finished`` when it ends: ``completed``, or ``error`` with its status message.
- a ``gen_ai.evaluation.result`` span event, or a span carrying
  ``gen_ai.evaluation.score.value`` → ``reward_assigned``.

Other spans (HTTP, database…) are ignored. Event ids are uuid5 of the key's project, the trace
id, span id and what the event is, so an export sent twice maps to the same ids, and another
project's span of the same ids is another event (span ids are scoped by project: an id known
in advance cannot drop another project's span); an LLM call whose span
carries the answer's id (``gen_ai.response.id``, OpenInference's JSON ``output.value``) takes
the id the capture gateway gives the call it answered (``api.call_ids``), so a call recorded
by both is stored once. Within an episode events go
in start-time order, its ``episode_finished`` last. A span whose GenAI attributes cannot be
read raises ``OtlpError`` naming the span and the attribute.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from api.call_ids import call_event_id, tool_event_id
from api.otlp.decode import STATUS_ERROR, OtlpError, Span, SpanEvent
from store.events import EpisodeFinished, Event, LLMCalled, RewardAssigned, ToolReturned

__all__ = [
    "EVENT_NAMESPACE",
    "EpisodeSpans",
    "episode_events",
    "event_id",
]

#: The namespace of the uuid5 event ids (``event_id``).
EVENT_NAMESPACE = uuid.UUID("5b0f3c1e-7d0a-5c8e-9f4e-0c1a7e2d6b90")

LLM_OPERATIONS = frozenset({"chat", "text_completion", "generate_content"})

# trajstore's own attributes, for what the conventions do not carry.
A_EPISODE = "trajstore.episode_id"
A_RUN = "trajstore.run_id"
A_GROUP = "trajstore.group_id"
A_TASK = "trajstore.task_id"
A_POLICY = "trajstore.policy_version"
A_LOGPROBS = "trajstore.logprobs"
A_PROMPT_IDS = "prompt_token_ids"  # Agent Lightning's name
A_RESPONSE_IDS = "response_token_ids"  # Agent Lightning's name
A_REWARD = "trajstore.reward"
A_STATUS = "trajstore.episode.status"

_STATUSES = ("completed", "terminated", "truncated", "error", "aborted")


def event_id(project: str, trace_id: str, span_id: str, what: str) -> uuid.UUID:
    """The id of the event ``what`` (``llm``, ``tool``, ``finish``, ``reward:N``) made from
    the span ``trace_id``/``span_id`` exported to ``project``: the same span always gives the
    same id in one project, and another in another project."""
    return uuid.uuid5(EVENT_NAMESPACE, json.dumps([project, trace_id, span_id, what]))


@dataclass
class EpisodeSpans:
    """What the spans of one episode give: its events (in the order to append), the run,
    group and task named by the spans (None where none does), the first LLM call's
    request messages, tools and model (for the episode's ``episode_started`` and its run),
    the number of spans the events came from, and where in the export each event's span is
    (``wheres``, beside ``events``). ``unversioned``: ids of LLM calls that name no policy
    version (they take the episode's)."""

    episode_id: str
    run_id: str | None = None
    group_id: str | None = None
    task_id: str | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)
    model: str | None = None
    events: list[Event] = field(default_factory=list)
    wheres: list[str] = field(default_factory=list)
    unversioned: set[uuid.UUID] = field(default_factory=set)
    #: For each tool call stored under the id its episode and tool call id give (the id the
    #: gateway gives the same call, ``api.call_ids.tool_event_id``), the span's own id, for
    #: when the shared one holds another call of that tool call id; likewise for each LLM
    #: call stored under its answer's id (``api.call_ids.call_event_id``), for when another
    #: project's event holds that id.
    own_ids: dict[uuid.UUID, uuid.UUID] = field(default_factory=dict)
    spans: int = 0
    where: str = ""
    first_call_ns: int | None = None


# --- which span is what ---------------------------------------------------------------------


def _kind(span: Span) -> str | None:
    op = span.attributes.get("gen_ai.operation.name")
    if isinstance(op, str):
        if op in LLM_OPERATIONS:
            return "llm"
        if op == "execute_tool":
            return "tool"
        if op == "invoke_agent":
            return "agent"
    oi = span.attributes.get("openinference.span.kind")
    if isinstance(oi, str):
        oi = oi.upper()
        if oi == "LLM":
            return "llm"
        if oi == "TOOL":
            return "tool"
        if oi == "AGENT":
            return "agent"
    request_type = span.attributes.get("llm.request.type")  # OpenLLMetry
    if request_type in ("chat", "completion"):
        return "llm"
    traceloop = span.attributes.get("traceloop.span.kind")
    if traceloop == "tool":
        return "tool"
    if traceloop == "agent":
        return "agent"
    return None


class _Batch:
    """The spans of one export, by id, for what a span inherits from its ancestors."""

    def __init__(self, spans: Sequence[Span], project: str) -> None:
        self.project = project
        self.by_id = {(s.trace_id, s.span_id): s for s in spans}
        self.trace_conversation: dict[str, str] = {}
        for s in spans:
            conv = _conversation(s)
            if conv is not None:
                self.trace_conversation.setdefault(s.trace_id, conv)

    def ancestors(self, span: Span) -> Iterable[Span]:
        yield span
        seen = {span.span_id}
        parent = span.parent_span_id
        while parent is not None and parent not in seen:
            seen.add(parent)
            found = self.by_id.get((span.trace_id, parent))
            if found is None:
                return
            yield found
            parent = found.parent_span_id

    def inherited(self, span: Span, *names: str) -> Any:
        for s in self.ancestors(span):
            value = s.attr(*names)
            if value is not None:
                return value
        return None

    def episode(self, span: Span) -> str:
        for s in self.ancestors(span):
            conv = _conversation(s)
            if conv is not None:
                return conv
        return self.trace_conversation.get(span.trace_id, span.trace_id)


def _conversation(span: Span) -> str | None:
    value = span.attr(A_EPISODE, "gen_ai.conversation.id", "session.id")
    return None if value is None else str(value)


# --- attribute readers ----------------------------------------------------------------------


def _bad(span: Span, name: str, what: str) -> OtlpError:
    return OtlpError(f"attribute {name!r}: {what}", where=span.where)


def _json_attr(span: Span, name: str) -> Any:
    """A JSON-valued attribute: a JSON string parsed, or a structured value as is."""
    value = span.attributes.get(name)
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as exc:
            raise _bad(span, name, f"is not valid JSON: {exc}") from None
    return value


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def _arguments(value: Any) -> str:
    """Tool call arguments as OpenAI writes them: a JSON text."""
    if isinstance(value, str):
        return value
    return json.dumps(value if value is not None else {}, ensure_ascii=False)


def _json_list(span: Span, name: str, what: str) -> list[Any] | None:
    """Attribute ``name`` as a list (an OTLP array, or a JSON array in a string); None when
    absent; a 400 naming ``what`` it must hold otherwise."""
    value = span.attr(name)
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise _bad(span, name, f"must be an array of {what}") from None
    if not isinstance(value, list):
        raise _bad(span, name, f"must be an array of {what}")
    return value


def _int_list(span: Span, name: str) -> list[int] | None:
    value = _json_list(span, name, "integers")
    if value is None:
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise _bad(span, name, "must be an array of integers")
    if any(not 0 <= v <= 2**31 - 1 for v in value):
        raise _bad(span, name, "token ids must lie in 0..2147483647 (int32)")
    return value


def _float_list(span: Span, name: str) -> list[float] | None:
    value = _json_list(span, name, "numbers")
    if value is None:
        return None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise _bad(span, name, "must be an array of numbers")
    return [float(v) for v in value]


def _tree(attributes: Mapping[str, Any], prefix: str) -> Any:
    """Flattened attributes under ``prefix`` (``llm.input_messages.0.message.role``) as the
    nested value they flatten (``[{"message": {"role": ...}}]``); None when there are none."""
    root: dict[str, Any] = {}
    start = prefix + "."
    for key, value in attributes.items():
        if not key.startswith(start):
            continue
        node = root
        parts = key[len(start):].split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[parts[-1]] = value
    return _lists(root) if root else None


def _lists(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    out = {k: _lists(v) for k, v in node.items()}
    if out and all(k.isdigit() for k in out):
        return [out[k] for k in sorted(out, key=int)]
    return out


# --- messages -------------------------------------------------------------------------------


def _tool_call(call_id: Any, name: Any, arguments: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "function",
                           "function": {"name": _text(name), "arguments": _arguments(arguments)}}
    if call_id is not None:
        out["id"] = str(call_id)
    return out


def _parts_messages(span: Span, name: str, messages: Any) -> list[dict[str, Any]]:
    """GenAI messages (``{"role", "parts": [...]}``, the current convention) as chat
    messages: text parts joined into ``content``, ``tool_call`` parts as ``tool_calls``,
    each ``tool_call_response`` part a ``tool`` message, ``reasoning`` parts as
    ``reasoning_content``."""
    if not isinstance(messages, list):
        raise _bad(span, name, "must be a JSON array of messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise _bad(span, name, f"message {i} must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise _bad(span, name, f"message {i} has no role")
        parts = message.get("parts")
        if parts is None and "content" in message:  # already a chat message
            out.append({k: v for k, v in message.items() if v is not None})
            out[-1].setdefault("content", "")
            continue
        if not isinstance(parts, list):
            raise _bad(span, name, f"message {i} must have a list of parts")
        texts: list[str] = []
        reasoning: list[str] = []
        calls: list[dict[str, Any]] = []
        responses: list[dict[str, Any]] = []
        for part in parts:
            if not isinstance(part, Mapping):
                raise _bad(span, name, f"message {i} has a part that is not an object")
            kind = part.get("type")
            if kind == "text":
                texts.append(_text(part.get("content")))
            elif kind == "reasoning":
                reasoning.append(_text(part.get("content")))
            elif kind == "tool_call":
                calls.append(_tool_call(part.get("id"), part.get("name"),
                                        part.get("arguments")))
            elif kind == "tool_call_response":
                response: dict[str, Any] = {"role": "tool",
                                            "content": _text(part.get("response"))}
                if part.get("id") is not None:
                    response["tool_call_id"] = str(part.get("id"))
                responses.append(response)
            else:  # blob, file, uri and what comes later: kept as its text form
                texts.append(_text(part.get("content", dict(part))))
        if responses and not texts and not calls:
            out.extend(responses)
            continue
        chat: dict[str, Any] = {"role": role, "content": "".join(texts)}
        if message.get("name"):
            chat["name"] = str(message["name"])
        if reasoning:
            chat["reasoning_content"] = "".join(reasoning)
        if calls:
            chat["tool_calls"] = calls
        out.append(chat)
        out.extend(responses)
    return out


def _system_instructions(span: Span) -> list[dict[str, Any]]:
    value = _json_attr(span, "gen_ai.system_instructions")
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "system", "content": value}]
    if not isinstance(value, list):
        raise _bad(span, "gen_ai.system_instructions", "must be a JSON array of parts")
    texts = [_text(p.get("content")) if isinstance(p, Mapping) else _text(p) for p in value]
    return [{"role": "system", "content": "".join(texts)}]


def _indexed_messages(node: Any) -> list[dict[str, Any]]:
    """OpenLLMetry's ``gen_ai.prompt.N.{role,content,tool_calls.M.*,tool_call_id}``."""
    out = []
    for item in node if isinstance(node, list) else []:
        if not isinstance(item, dict):
            continue
        message: dict[str, Any] = {"role": _text(item.get("role") or "user"),
                                   "content": _text(item.get("content"))}
        calls = item.get("tool_calls")
        if isinstance(calls, list):
            message["tool_calls"] = [
                _tool_call(c.get("id"), c.get("name"), c.get("arguments"))
                for c in calls if isinstance(c, dict)]
        if item.get("tool_call_id") is not None:
            message["tool_call_id"] = _text(item["tool_call_id"])
        out.append(message)
    return out


def _openinference_messages(node: Any) -> list[dict[str, Any]]:
    """OpenInference's ``llm.input_messages.N.message.{role,content,contents,tool_calls,
    tool_call_id}``."""
    out = []
    for item in node if isinstance(node, list) else []:
        message = item.get("message") if isinstance(item, dict) else None
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if content is None and isinstance(message.get("contents"), list):
            content = "".join(
                _text((c.get("message_content") or {}).get("text"))
                for c in message["contents"] if isinstance(c, dict))
        chat: dict[str, Any] = {"role": _text(message.get("role") or "user"),
                                "content": _text(content)}
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            chat["tool_calls"] = []
            for c in calls:
                call = c.get("tool_call") if isinstance(c, dict) else None
                if isinstance(call, dict):
                    function = call.get("function") or {}
                    chat["tool_calls"].append(_tool_call(
                        call.get("id"), function.get("name"), function.get("arguments")))
        if message.get("tool_call_id") is not None:
            chat["tool_call_id"] = _text(message["tool_call_id"])
        if message.get("name") is not None:
            chat["name"] = _text(message["name"])
        out.append(chat)
    return out


def _event_messages(span: Span) -> tuple[list[dict[str, Any]], dict[str, Any] | None,
                                         str | None]:
    """Request messages and the first choice from span events of the older GenAI event
    convention (``gen_ai.{system,user,assistant,tool}.message``, ``gen_ai.choice``)."""
    messages: list[dict[str, Any]] = []
    choice: dict[str, Any] | None = None
    finish: str | None = None
    for e in span.events:
        role = {"gen_ai.system.message": "system", "gen_ai.user.message": "user",
                "gen_ai.assistant.message": "assistant",
                "gen_ai.tool.message": "tool"}.get(e.name)
        if role is not None:
            message: dict[str, Any] = {"role": _text(e.attributes.get("role") or role),
                                       "content": _text(e.attributes.get("content"))}
            calls = _event_json(span, e, "tool_calls")
            if isinstance(calls, list) and calls:
                message["tool_calls"] = [_openai_call(c) for c in calls
                                         if isinstance(c, Mapping)]
            if role == "tool" and e.attributes.get("id") is not None:
                message["tool_call_id"] = _text(e.attributes["id"])
            messages.append(message)
        elif e.name == "gen_ai.choice" and choice is None:
            body = _event_json(span, e, "message")
            if not isinstance(body, Mapping):
                body = {"content": e.attributes.get("content")}
            choice = {"role": _text(body.get("role") or "assistant"),
                      "content": _text(body.get("content"))}
            calls = body.get("tool_calls")
            if isinstance(calls, list) and calls:
                choice["tool_calls"] = [_openai_call(c) for c in calls
                                        if isinstance(c, Mapping)]
            reason = e.attributes.get("finish_reason")
            finish = str(reason) if reason is not None else None
    return messages, choice, finish


def _event_json(span: Span, event: SpanEvent, name: str) -> Any:
    value = event.attributes.get(name)
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            raise _bad(span, f"{event.name}.{name}", "is not valid JSON") from None
    return value


def _openai_call(call: Mapping[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if isinstance(function, Mapping):
        return _tool_call(call.get("id"), function.get("name"), function.get("arguments"))
    return _tool_call(call.get("id"), call.get("name"), call.get("arguments"))


def _tools(span: Span) -> list[dict[str, Any]]:
    """Tool definitions (``gen_ai.tool.definitions``, OpenInference's
    ``llm.tools.N.tool.json_schema``) in OpenAI's form."""
    value = _json_attr(span, "gen_ai.tool.definitions")
    if value is None:
        node = _tree(span.attributes, "llm.tools")
        value = []
        for item in node if isinstance(node, list) else []:
            schema = (item.get("tool") or {}).get("json_schema") if isinstance(item, dict) \
                else None
            if isinstance(schema, str):
                try:
                    value.append(json.loads(schema))
                except ValueError:
                    raise _bad(span, "llm.tools.N.tool.json_schema",
                               "is not valid JSON") from None
            elif isinstance(schema, dict):
                value.append(schema)
    if not isinstance(value, list):
        raise _bad(span, "gen_ai.tool.definitions", "must be a JSON array of tools")
    out = []
    for tool in value:
        if not isinstance(tool, Mapping):
            continue
        if "function" in tool:
            out.append(dict(tool))
        else:
            definition = {k: v for k, v in tool.items() if k != "type"}
            out.append({"type": "function", "function": definition})
    return out


# --- spans to events ------------------------------------------------------------------------


_MAX_NS = int(dt.datetime(9999, 12, 31, tzinfo=dt.UTC).timestamp()) * 10**9


def _time(ns: int) -> dt.datetime | None:
    """A span time as a datetime (None when unset); a time past the year 9999 (only JSON
    can say so) is clamped to it, where datetimes end."""
    if ns <= 0:
        return None
    return dt.datetime.fromtimestamp(min(ns, _MAX_NS) / 1e9, dt.UTC)


def _duration_ms(span: Span) -> float | None:
    if span.start_ns and span.end_ns:
        return (span.end_ns - span.start_ns) / 1e6
    return None


def _agent(batch: _Batch, span: Span) -> str:
    value = batch.inherited(span, "gen_ai.agent.name", "agent.name")
    return str(value)[:200] if value not in (None, "") else "main"


def _int_attr(span: Span, name: str) -> int | None:
    value = span.attr(name)
    if value is None:
        return None
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _bad(span, name, "must be a non-negative integer")
    return value


def _llm_call(batch: _Batch, span: Span) -> tuple[LLMCalled, list[dict[str, Any]],
                                                  list[dict[str, Any]], str | None]:
    a = span.attributes
    messages: list[dict[str, Any]] = []
    response: dict[str, Any] | None = None
    finish: str | None = None
    if "gen_ai.input.messages" in a or "gen_ai.output.messages" in a:
        messages = _system_instructions(span)
        inputs = _json_attr(span, "gen_ai.input.messages")
        if inputs is not None:
            messages += _parts_messages(span, "gen_ai.input.messages", inputs)
        outputs = _json_attr(span, "gen_ai.output.messages")
        if outputs is not None:
            converted = _parts_messages(span, "gen_ai.output.messages", outputs)
            response = converted[0] if converted else None
            if isinstance(outputs, list) and outputs and isinstance(outputs[0], Mapping):
                reason = outputs[0].get("finish_reason")
                finish = str(reason) if reason is not None else None
    elif _tree(a, "llm.input_messages") is not None or _tree(a, "llm.output_messages"):
        messages = _openinference_messages(_tree(a, "llm.input_messages"))
        outputs = _openinference_messages(_tree(a, "llm.output_messages"))
        response = outputs[0] if outputs else None
    elif _tree(a, "gen_ai.prompt") is not None or _tree(a, "gen_ai.completion") is not None:
        messages = _indexed_messages(_tree(a, "gen_ai.prompt"))
        completions = _tree(a, "gen_ai.completion")
        outputs = _indexed_messages(completions)
        response = outputs[0] if outputs else None
        if isinstance(completions, list) and completions and isinstance(completions[0], dict):
            reason = completions[0].get("finish_reason")
            finish = str(reason) if reason is not None else None
    else:
        messages, response, finish = _event_messages(span)
    if response is None and a.get("output.value") is not None:  # OpenInference, plain text
        response = {"role": "assistant", "content": _text(a.get("output.value"))}
    reasons = a.get("gen_ai.response.finish_reasons")
    if finish is None and isinstance(reasons, list) and reasons:
        finish = str(reasons[0])
    response = dict(response or {"role": "assistant", "content": ""})
    response["role"] = "assistant"
    response["otlp"] = {"trace_id": span.trace_id, "span_id": span.span_id}
    answer_id = _response_id(span)
    if answer_id is not None:
        response["otlp"]["response_id"] = answer_id
    if span.status_code == STATUS_ERROR or a.get("error.type") is not None:
        # The request failed (refused, timed out, rate-limited): recorded with its error.
        response["error"] = {"type": _text(a.get("error.type") or "error"),
                             "message": span.status_message}
        finish = finish or "error"
    tools = _tools(span)
    prompt_ids = _int_list(span, A_PROMPT_IDS) or []
    response_ids = _int_list(span, A_RESPONSE_IDS) or []
    logprobs = _float_list(span, A_LOGPROBS)
    if logprobs is None:
        if response_ids:
            raise _bad(span, A_LOGPROBS, f"is missing: {A_RESPONSE_IDS} needs the logprob of "
                                         "each generated token")
        logprobs = []
    if (prompt_ids or response_ids) and not (prompt_ids and response_ids):
        missing = A_RESPONSE_IDS if prompt_ids else A_PROMPT_IDS
        raise _bad(span, missing, "is missing: token ids come as a pair, prompt and response")
    usage = {k: v for k, v in (
        ("prompt_tokens", a.get("gen_ai.usage.input_tokens", a.get("llm.token_count.prompt"))),
        ("completion_tokens",
         a.get("gen_ai.usage.output_tokens", a.get("llm.token_count.completion"))),
    ) if isinstance(v, int) and not isinstance(v, bool)}
    model = a.get("gen_ai.request.model", a.get("gen_ai.response.model",
                                                 a.get("llm.model_name")))
    try:
        event = LLMCalled(
            # The answer's id, when the span knows it, names the call as the capture gateway
            # names it: the log keeps one of the two records (api.call_ids).
            event_id=(call_event_id(answer_id) if answer_id is not None
                      else event_id(batch.project, span.trace_id, span.span_id, "llm")),
            occurred_at=_time(span.start_ns), agent=_agent(batch, span),
            call_id=span.span_id, messages=messages, tools=tools or None,
            prompt_ids=np.asarray(prompt_ids, dtype=np.int64),
            response_ids=np.asarray(response_ids, dtype=np.int64),
            logprobs=np.asarray(logprobs, dtype=np.float64), response=response,
            finish_reason=finish, policy_version=_int_attr(span, A_POLICY) or 0,
            latency_ms=_duration_ms(span), usage=usage or None)
    except ValueError as exc:  # pydantic's ValidationError is one
        raise OtlpError(f"the span does not make an llm_called event: {_first(exc)}",
                        where=span.where) from None
    return event, messages, tools, str(model) if isinstance(model, str) else None


def _response_id(span: Span) -> str | None:
    """The id of the answer the span's call got: ``gen_ai.response.id``, else the ``id`` of
    OpenInference's JSON ``output.value``; None when the span has neither (a failed call)."""
    a = span.attributes
    value = a.get("gen_ai.response.id")
    if isinstance(value, str) and value:
        return value
    output = a.get("output.value")
    if a.get("output.mime_type") == "application/json" and isinstance(output, str):
        try:
            decoded = json.loads(output)
        except ValueError:
            return None
        if isinstance(decoded, Mapping) and isinstance(decoded.get("id"), str) \
                and decoded["id"]:
            return str(decoded["id"])
    return None


def _first(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = errors()[0]
        return f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"
    return str(exc)


def _tool_call_event(batch: _Batch, span: Span) -> ToolReturned:
    a = span.attributes
    name = a.get("gen_ai.tool.name", a.get("tool.name"))
    if name in (None, ""):
        name = span.name.removeprefix("execute_tool ").strip() or "tool"
    raw = a.get("gen_ai.tool.call.arguments")
    if raw is None:
        raw = a.get("tool.parameters") if "input.value" not in a else a.get("input.value")
    if isinstance(raw, str):
        # A model's malformed arguments are a failure to record, not a request to refuse:
        # kept as text under "input".
        try:
            raw = json.loads(raw)
        except ValueError:
            pass
    arguments = dict(raw) if isinstance(raw, Mapping) else (
        {} if raw is None else {"input": raw})
    output = a.get("gen_ai.tool.call.result", a.get("output.value"))
    error_type = a.get("error.type")
    exception = next((e for e in span.events if e.name == "exception"), None)
    failed = span.status_code == STATUS_ERROR or error_type is not None
    message = span.status_message or None
    if exception is not None and failed:
        error_type = error_type or exception.attributes.get("exception.type")
        message = message or exception.attributes.get("exception.message")
    call_id = a.get("gen_ai.tool.call.id", a.get("tool_call.id"))
    try:
        return ToolReturned(
            event_id=event_id(batch.project, span.trace_id, span.span_id, "tool"),
            occurred_at=_time(span.start_ns), agent=_agent(batch, span),
            tool_call_id=None if call_id is None else str(call_id), name=str(name)[:200],
            arguments=arguments, output=_text(output) if output is not None else (
                message or "" if failed else ""),
            is_error=failed, error_type=str(error_type or "error") if failed else None,
            error_message=None if message is None else str(message),
            duration_ms=_duration_ms(span))
    except ValueError as exc:
        raise OtlpError(f"the span does not make a tool_returned event: {_first(exc)}",
                        where=span.where) from None


def _finish(batch: _Batch, span: Span) -> EpisodeFinished:
    status = span.attr(A_STATUS)
    if status is not None and status not in _STATUSES:
        raise _bad(span, A_STATUS, f"must be one of {', '.join(_STATUSES)}")
    failed = span.status_code == STATUS_ERROR
    if status is None:
        status = "error" if failed else "completed"
    reason = span.status_message or span.attributes.get("error.type") if failed else None
    return EpisodeFinished(event_id=event_id(batch.project, span.trace_id, span.span_id,
                                             "finish"),
                           occurred_at=_time(span.end_ns), status=status,
                           reason=None if reason is None else str(reason))


def _score(span: Span, where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            return float(value)
        except (TypeError, ValueError):
            raise _bad(span, where, "must be a number") from None
    return float(value)


def _rewards(batch: _Batch, span: Span) -> list[tuple[int, RewardAssigned]]:
    """Rewards the span carries: its ``gen_ai.evaluation.result`` events, and the span's own
    evaluation attributes (or ``trajstore.reward``), with the time each one counts from."""
    found: list[tuple[int, str, Any, Mapping[str, Any]]] = []
    for i, e in enumerate(span.events):
        if e.name == "gen_ai.evaluation.result" and \
                e.attributes.get("gen_ai.evaluation.score.value") is not None:
            found.append((e.time_ns or span.end_ns, f"reward:{i}",
                          e.attributes["gen_ai.evaluation.score.value"], e.attributes))
    for name in ("gen_ai.evaluation.score.value", A_REWARD):
        if span.attributes.get(name) is not None:
            found.append((span.end_ns, "reward", span.attributes[name], span.attributes))
            break
    out = []
    for at, what, value, attrs in found:
        score = _score(span, "gen_ai.evaluation.score.value", value)
        label = attrs.get("gen_ai.evaluation.name")
        try:
            out.append((at, RewardAssigned(
                event_id=event_id(batch.project, span.trace_id, span.span_id, what),
                occurred_at=_time(at),
                value=score, components={str(label): score} if label else {},
                source=f"otlp:{label}" if label else "otlp")))
        except ValueError as exc:
            raise OtlpError(f"the evaluation does not make a reward_assigned event: "
                            f"{_first(exc)}", where=span.where) from None
    return out


def _shared_tool_id(plan: EpisodeSpans, event: Event) -> Event:
    """A tool call span's event under the id the gateway gives the same call (its episode
    and tool call id), the first in this export to name that tool call id; others keep
    their span's id."""
    if not isinstance(event, ToolReturned) or not event.tool_call_id:
        return event
    shared = tool_event_id(plan.episode_id, event.tool_call_id)
    if shared in plan.own_ids:
        return event
    assert event.event_id is not None  # the span's own, always set here
    plan.own_ids[shared] = event.event_id
    return event.model_copy(update={"event_id": shared})


def episode_events(spans: Sequence[Span], *, project: str) -> list[EpisodeSpans]:
    """The events of ``spans`` exported to ``project`` grouped by episode (in order of first
    appearance), each episode's in the order to append them. Raises OtlpError for a span
    whose GenAI attributes cannot be read."""
    batch = _Batch(spans, project)
    episodes: dict[str, EpisodeSpans] = {}
    keyed: dict[str, list[tuple[tuple[int, int, str, str], Event, str]]] = {}
    for span in spans:
        own_llm: dict[uuid.UUID, uuid.UUID] = {}
        kind = _kind(span)
        items: list[tuple[tuple[int, int, str, str], Event]] = []
        first_call = None
        versioned = True
        if kind == "llm":
            call, messages, tools, model = _llm_call(batch, span)
            items.append(((0, span.start_ns, span.span_id, "llm"), call))
            first_call = (messages, tools, model)
            own = event_id(project, span.trace_id, span.span_id, "llm")
            if call.event_id != own:
                assert call.event_id is not None  # always set here
                own_llm[call.event_id] = own
            versioned = span.attr(A_POLICY) is not None
        elif kind == "tool":
            items.append(((0, span.start_ns, span.span_id, "tool"),
                          _tool_call_event(batch, span)))
        elif kind == "agent" and span.parent_span_id is None:
            items.append(((1, span.end_ns, span.span_id, "finish"), _finish(batch, span)))
        for at, reward in _rewards(batch, span):
            items.append(((0, at, span.span_id, str(reward.event_id)), reward))
        if not items:
            continue
        episode_id = batch.episode(span)
        plan = episodes.get(episode_id)
        if plan is None:
            plan = episodes[episode_id] = EpisodeSpans(episode_id=episode_id, where=span.where)
            keyed[episode_id] = []
        for attr, name in ((A_RUN, "run_id"), (A_GROUP, "group_id"), (A_TASK, "task_id")):
            value = batch.inherited(span, attr)
            if value is not None and getattr(plan, name) is None:
                setattr(plan, name, str(value))
        if first_call is not None and (plan.first_call_ns is None
                                       or span.start_ns < plan.first_call_ns):
            # The episode opens with what its earliest call was asked.
            plan.first_call_ns = span.start_ns
            plan.messages, plan.tools = first_call[0], first_call[1]
            plan.model = first_call[2] or plan.model
            if not versioned:
                plan.unversioned.add(items[0][1].event_id)  # type: ignore[arg-type]
        elif first_call is not None and not versioned:
            plan.unversioned.add(items[0][1].event_id)  # type: ignore[arg-type]
        plan.spans += 1
        plan.own_ids.update(own_llm)
        items = [(key, _shared_tool_id(plan, event)) for key, event in items]
        keyed[episode_id].extend((key, event, span.where) for key, event in items)
    for episode_id, plan in episodes.items():
        ordered = sorted(keyed[episode_id], key=lambda item: item[0])
        plan.events = [e for _, e, _ in ordered]
        plan.wheres = [w for _, _, w in ordered]
    return list(episodes.values())
