"""Decoding an OTLP/HTTP trace export (``ExportTraceServiceRequest``) into plain spans.

Both encodings of the OTLP specification are read: binary protobuf
(``application/x-protobuf``) and its JSON mapping (``application/json``: trace and span ids
as hex, 64-bit integers as numbers or strings, enums as numbers or names, attribute values
as ``{"stringValue": ...}``, ``{"intValue": ...}``…), either of them gzip-compressed
(``Content-Encoding: gzip``). Attribute values become plain Python values (arrays lists,
key-value lists dicts). What cannot be read raises ``OtlpError`` naming where it is, so that
the route answers 400 before anything is stored.

What one export may hold is bounded (``OtlpLimits``, from the settings ``OTLP_MAX_*``): spans
per export, attribute values per span (every key-value and array element, nested ones
included; a span's events and its resource count with it), the nesting depth of attribute
values and the length of a key. An export over one is refused with 413 naming the limit and
its setting, before anything is stored. Integers (times, ``intValue``, status codes) are
ASCII decimal digits within the 64 bits of their protobuf type: a 400-digit time, a
non-ASCII digit, an underscore or a space is a 400 naming the place; so is JSON nested past
what the parser can read.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

__all__ = [
    "JSON",
    "PROTOBUF",
    "OtlpError",
    "OtlpLimits",
    "Span",
    "SpanEvent",
    "decode_request",
    "decompress",
    "encode_response",
    "media_type",
]

PROTOBUF = "application/x-protobuf"
JSON = "application/json"

#: Span status codes (``Status.StatusCode``).
STATUS_UNSET, STATUS_OK, STATUS_ERROR = 0, 1, 2
_STATUS_NAMES = {"STATUS_CODE_UNSET": 0, "STATUS_CODE_OK": 1, "STATUS_CODE_ERROR": 2}


class OtlpError(ValueError):
    """The export cannot be read; ``where`` names the part (``resourceSpans[0].scopeSpans[0]
    .spans[3].traceId``), the message what is wrong with it."""

    def __init__(self, message: str, *, where: str | None = None,
                 status: int = 400) -> None:
        self.where = where
        self.status = status
        self.reason = message
        super().__init__(f"{where}: {message}" if where else message)

    def __reduce__(self) -> tuple[object, ...]:  # sent back from a decoding process
        return (_otlp_error, (self.reason, self.where, self.status))


def _otlp_error(message: str, where: str | None, status: int) -> OtlpError:
    return OtlpError(message, where=where, status=status)


@dataclass(frozen=True)
class OtlpLimits:
    """What one export may hold (module docstring); the defaults are the settings'."""

    max_spans: int = 4096
    max_attributes: int = 4096
    max_depth: int = 16
    max_key_chars: int = 1024

    @classmethod
    def of(cls, settings: Any) -> OtlpLimits:
        """The limits the ``OTLP_MAX_*`` settings give."""
        return cls(max_spans=settings.otlp_max_spans,
                   max_attributes=settings.otlp_max_attributes,
                   max_depth=settings.otlp_max_depth,
                   max_key_chars=settings.otlp_max_key_chars)


def _over(what: str, limit: int, setting: str, where: str | None = None) -> OtlpError:
    return OtlpError(f"{what} is over the limit of {limit} (setting "
                     f"TRAJSTORE_{setting})", where=where, status=413)


class _Budget:
    """Counts the attribute values of one span against ``OtlpLimits.max_attributes`` and
    checks keys and nesting."""

    def __init__(self, limits: OtlpLimits, where: str) -> None:
        self.limits = limits
        self.where = where
        self.count = 0

    def value(self, at: str, depth: int) -> None:
        self.count += 1
        if self.count > self.limits.max_attributes:
            raise _over("the number of attribute values of this span (its events and "
                        "resource included)", self.limits.max_attributes,
                        "OTLP_MAX_ATTRIBUTES", self.where)
        if depth > self.limits.max_depth:
            raise _over("the nesting depth of this attribute value", self.limits.max_depth,
                        "OTLP_MAX_DEPTH", at)

    def key(self, key: str, at: str) -> None:
        if len(key) > self.limits.max_key_chars:
            raise _over(f"the length of this attribute key ({len(key)} characters)",
                        self.limits.max_key_chars, "OTLP_MAX_KEY_CHARS", at)


@dataclass(frozen=True)
class SpanEvent:
    """An event inside a span (an exception, an older GenAI message event, an evaluation)."""

    name: str
    time_ns: int
    attributes: dict[str, Any]


@dataclass(frozen=True)
class Span:
    """One span with its resource's attributes; ids in lowercase hex, times in ns since the
    epoch, ``status_code`` 0 unset, 1 ok, 2 error; ``where`` its place in the export."""

    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[SpanEvent] = field(default_factory=list)
    status_code: int = STATUS_UNSET
    status_message: str = ""
    resource: dict[str, Any] = field(default_factory=dict)
    where: str = ""

    def attr(self, *names: str) -> Any:
        """The first of ``names`` set on the span, else on its resource, else None."""
        for scope in (self.attributes, self.resource):
            for name in names:
                value = scope.get(name)
                if value is not None:
                    return value
        return None


def media_type(content_type: str | None) -> str:
    """``PROTOBUF`` or ``JSON`` from a Content-Type header; OtlpError 415 otherwise."""
    kind = (content_type or "").split(";")[0].strip().lower()
    if kind in (PROTOBUF, "application/protobuf"):
        return PROTOBUF
    if kind == JSON:
        return JSON
    raise OtlpError(f"Content-Type {content_type!r} is not an OTLP encoding: send "
                    f"{PROTOBUF} or {JSON}", where="header.Content-Type", status=415)


_SIZE_SETTINGS = "TRAJSTORE_OTLP_MAX_BYTES, or TRAJSTORE_API_MAX_REQUEST_BYTES when smaller"


def decompress(body: bytes, encoding: str | None, *, max_bytes: int) -> bytes:
    """``body`` as sent with ``Content-Encoding: encoding`` (none, identity or gzip),
    decompressed up to ``max_bytes``. OtlpError 400 for a broken gzip stream, 413 past the
    limit, 415 for another encoding."""
    kind = (encoding or "identity").strip().lower()
    if kind == "identity":
        if len(body) > max_bytes:
            raise OtlpError(f"the body is over the limit of {max_bytes} bytes (setting "
                            f"{_SIZE_SETTINGS})", status=413)
        return body
    if kind != "gzip":
        raise OtlpError(f"Content-Encoding {encoding!r} is not supported: send gzip or "
                        "nothing", where="header.Content-Encoding", status=415)
    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        out = inflater.decompress(body, max_bytes + 1)
    except zlib.error as exc:
        raise OtlpError(f"the body is not valid gzip: {exc}",
                        where="header.Content-Encoding") from None
    if len(out) > max_bytes:
        raise OtlpError(f"the body decompresses to more than the limit of {max_bytes} bytes "
                        f"(setting {_SIZE_SETTINGS})", status=413)
    if not inflater.eof:
        raise OtlpError("the gzip stream is truncated", where="header.Content-Encoding")
    return out


def decode_request(body: bytes, kind: str, limits: OtlpLimits | None = None) -> list[Span]:
    """The spans of an export encoded as ``kind`` (``PROTOBUF`` or ``JSON``). OtlpError
    naming the place for anything malformed: undecodable bytes or JSON, a value of the wrong
    type, a trace id that is not 16 bytes, a span id that is not 8, an end before a start, an
    integer that is not ASCII digits within 64 bits; OtlpError 413 naming the limit and its
    setting for an export over ``limits`` (module docstring)."""
    limits = limits or OtlpLimits()
    if kind == PROTOBUF:
        return _from_protobuf(body, limits)
    return _from_json(body, limits)


def encode_response(kind: str, *, rejected: int = 0, message: str = "") -> bytes:
    """An ``ExportTraceServiceResponse`` in the request's encoding, with ``partial_success``
    when spans were rejected."""
    response = ExportTraceServiceResponse()
    if rejected or message:
        response.partial_success.rejected_spans = rejected
        response.partial_success.error_message = message
    if kind == PROTOBUF:
        return response.SerializeToString()
    out: dict[str, Any] = {}
    if rejected or message:
        out["partialSuccess"] = {"rejectedSpans": str(rejected), "errorMessage": message}
    return json.dumps(out).encode()


# --- protobuf ------------------------------------------------------------------------------


def _any_value(value: AnyValue, budget: _Budget, at: str, depth: int) -> Any:
    budget.value(at, depth)
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [_any_value(v, budget, f"{at}.arrayValue.values[{i}]", depth + 1)
                for i, v in enumerate(value.array_value.values)]
    if which == "kvlist_value":
        return _pb_attributes(value.kvlist_value.values, budget, f"{at}.kvlistValue.values",
                              depth + 1)
    if which == "bytes_value":
        return base64.b64encode(value.bytes_value).decode()
    return getattr(value, which)


def _pb_attributes(items: Any, budget: _Budget, where: str, depth: int = 1
                   ) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, kv in enumerate(items):
        budget.key(kv.key, f"{where}[{i}].key")
        out[kv.key] = _any_value(kv.value, budget, f"{where}[{i}].value", depth)
    return out


def _span_count(groups: Any, limits: OtlpLimits, count: Any) -> None:
    total = sum(count(g) for g in groups)
    if total > limits.max_spans:
        raise _over(f"the number of spans in the export ({total})", limits.max_spans,
                    "OTLP_MAX_SPANS")


def _from_protobuf(body: bytes, limits: OtlpLimits) -> list[Span]:
    request = ExportTraceServiceRequest()
    try:
        request.ParseFromString(body)
    except (DecodeError, RuntimeError, ValueError, RecursionError) as exc:
        raise OtlpError(f"the body is not an ExportTraceServiceRequest in protobuf: {exc}"
                        ) from None
    _span_count(request.resource_spans, limits,
                lambda rs: sum(len(ss.spans) for ss in rs.scope_spans))
    spans = []
    for r, rs in enumerate(request.resource_spans):
        rwhere = f"resourceSpans[{r}].resource.attributes"
        resource_budget = _Budget(limits, rwhere)
        resource = _pb_attributes(rs.resource.attributes, resource_budget, rwhere)
        for s, ss in enumerate(rs.scope_spans):
            for i, span in enumerate(ss.spans):
                where = f"resourceSpans[{r}].scopeSpans[{s}].spans[{i}]"
                budget = _Budget(limits, where)
                budget.count = resource_budget.count
                spans.append(_span(
                    where, trace_id=_hex(span.trace_id, 16, where + ".traceId"),
                    span_id=_hex(span.span_id, 8, where + ".spanId"),
                    parent=(_hex(span.parent_span_id, 8, where + ".parentSpanId")
                            if span.parent_span_id else None),
                    name=span.name, start=span.start_time_unix_nano,
                    end=span.end_time_unix_nano,
                    attributes=_pb_attributes(span.attributes, budget,
                                              where + ".attributes"),
                    events=[SpanEvent(e.name, e.time_unix_nano,
                                      _pb_attributes(e.attributes, budget,
                                                     f"{where}.events[{k}].attributes"))
                            for k, e in enumerate(span.events)],
                    status=int(span.status.code), message=span.status.message,
                    resource=resource))
    return spans


def _hex(raw: bytes, size: int, where: str) -> str:
    if len(raw) != size or not any(raw):
        raise OtlpError(f"must be {size} bytes, not all zero (got {len(raw)} bytes)",
                        where=where)
    return raw.hex()


def _span(where: str, *, trace_id: str, span_id: str, parent: str | None, name: str,
          start: int, end: int, attributes: dict[str, Any], events: list[SpanEvent],
          status: int, message: str, resource: dict[str, Any]) -> Span:
    if end and start and end < start:
        raise OtlpError(f"ends ({end}) before it starts ({start})",
                        where=where + ".endTimeUnixNano")
    if status not in (STATUS_UNSET, STATUS_OK, STATUS_ERROR):
        raise OtlpError(f"unknown status code {status}", where=where + ".status.code")
    return Span(trace_id=trace_id, span_id=span_id, parent_span_id=parent, name=name,
                start_ns=start, end_ns=end or start, attributes=attributes, events=events,
                status_code=status, status_message=message, resource=resource, where=where)


# --- JSON ----------------------------------------------------------------------------------


def _get(obj: Mapping[str, Any], camel: str, default: Any = None) -> Any:
    """A field by its JSON name, or by its protobuf (snake_case) name."""
    if camel in obj:
        return obj[camel]
    snake = "".join("_" + c.lower() if c.isupper() else c for c in camel)
    return obj.get(snake, default)


def _list(obj: Mapping[str, Any], camel: str, where: str) -> list[Any]:
    value = _get(obj, camel)
    if value is None:
        return []
    if not isinstance(value, list):
        raise OtlpError(f"must be a list, got {type(value).__name__}", where=f"{where}.{camel}")
    return value


def _object(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise OtlpError(f"must be an object, got {type(value).__name__}", where=where)
    return value


_DIGITS = re.compile(r"-?[0-9]{1,20}")
_INT64 = (-(2**63), 2**63 - 1)
_UINT64 = (0, 2**64 - 1)


def _int(value: Any, where: str, bounds: tuple[int, int] = _UINT64) -> int:
    """An integer of a 64-bit field (``bounds``): a JSON number or a string of ASCII
    decimal digits; OtlpError for anything else or out of bounds."""
    if isinstance(value, bool):
        raise OtlpError("must be an integer, not a boolean", where=where)
    number: int | None = None
    if isinstance(value, int):
        number = value
    elif isinstance(value, str) and _DIGITS.fullmatch(value):
        number = int(value)
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    if number is None:
        raise OtlpError(f"must be an integer (ASCII decimal digits), got {value!r:.60}",
                        where=where)
    if not bounds[0] <= number <= bounds[1]:
        raise OtlpError(f"must be an integer from {bounds[0]} to {bounds[1]}, got "
                        f"{str(number)[:30]}{'…' if len(str(number)) > 30 else ''}",
                        where=where)
    return number


def _json_hex(value: Any, size: int, where: str, *, optional: bool = False) -> str | None:
    if optional and value in (None, ""):
        return None
    if not isinstance(value, str):
        raise OtlpError(f"must be a hex string of {size} bytes, got {value!r:.60}", where=where)
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raise OtlpError(f"must be a hex string of {size} bytes, got {value!r:.60}",
                        where=where) from None
    return _hex(raw, size, where)


def _json_value(value: Any, where: str, budget: _Budget, depth: int) -> Any:
    budget.value(where, depth)
    obj = _object(value, where)
    if not obj:
        return None
    if len(obj) != 1:
        raise OtlpError(f"an AnyValue holds one of stringValue, boolValue, intValue, "
                        f"doubleValue, arrayValue, kvlistValue, bytesValue; got "
                        f"{sorted(obj)}", where=where)
    (key, inner), = obj.items()
    name = {"string_value": "stringValue", "bool_value": "boolValue",
            "int_value": "intValue", "double_value": "doubleValue",
            "array_value": "arrayValue", "kvlist_value": "kvlistValue",
            "bytes_value": "bytesValue"}.get(key, key)
    at = f"{where}.{name}"
    if name == "stringValue":
        if not isinstance(inner, str):
            raise OtlpError("must be a string", where=at)
        return inner
    if name == "boolValue":
        if not isinstance(inner, bool):
            raise OtlpError("must be a boolean", where=at)
        return inner
    if name == "intValue":
        return _int(inner, at, _INT64)
    if name == "doubleValue":
        if isinstance(inner, bool) or not isinstance(inner, (int, float, str)):
            raise OtlpError("must be a number", where=at)
        try:
            return float(inner)
        except ValueError:
            raise OtlpError(f"must be a number, got {inner!r:.60}", where=at) from None
    if name == "arrayValue":
        values = _list(_object(inner, at), "values", at)
        return [_json_value(v, f"{at}.values[{i}]", budget, depth + 1)
                for i, v in enumerate(values)]
    if name == "kvlistValue":
        return _json_attributes(_list(_object(inner, at), "values", at), f"{at}.values",
                                budget, depth + 1)
    if name == "bytesValue":
        if not isinstance(inner, str):
            raise OtlpError("must be base64 text", where=at)
        try:
            base64.b64decode(inner, validate=True)
        except (binascii.Error, ValueError):
            raise OtlpError("must be base64 text", where=at) from None
        return inner
    raise OtlpError(f"unknown AnyValue field {key!r}", where=where)


def _json_attributes(items: list[Any], where: str, budget: _Budget, depth: int = 1
                     ) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        kv = _object(item, at)
        key = kv.get("key")
        if not isinstance(key, str):
            raise OtlpError("must have a string key", where=at)
        budget.key(key, at + ".key")
        out[key] = _json_value(kv.get("value", {}), f"{at}.value", budget, depth)
    return out


def _json_enum(value: Any, names: Mapping[str, int], where: str) -> int:
    if isinstance(value, str) and value in names:
        return names[value]
    if value is None:
        return 0
    return _int(value, where, _INT64)


def _json_span_count(root: Mapping[str, Any], limits: OtlpLimits) -> None:
    total = 0
    for r, rs in enumerate(_list(root, "resourceSpans", "(body)")):
        rs = _object(rs, f"resourceSpans[{r}]")
        for s, ss in enumerate(_list(rs, "scopeSpans", f"resourceSpans[{r}]")):
            ss = _object(ss, f"resourceSpans[{r}].scopeSpans[{s}]")
            total += len(_list(ss, "spans", f"resourceSpans[{r}].scopeSpans[{s}]"))
    if total > limits.max_spans:
        raise _over(f"the number of spans in the export ({total})", limits.max_spans,
                    "OTLP_MAX_SPANS")


def _from_json(body: bytes, limits: OtlpLimits) -> list[Span]:
    try:
        data = json.loads(body)
    except RecursionError:
        raise OtlpError("the body is not JSON the server reads: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise OtlpError(f"the body is not JSON: {exc}") from None
    root = _object(data, "(body)")
    _json_span_count(root, limits)
    spans = []
    for r, rs in enumerate(_list(root, "resourceSpans", "(body)")):
        rwhere = f"resourceSpans[{r}]"
        rs = _object(rs, rwhere)
        resource = _object(_get(rs, "resource") or {}, rwhere + ".resource")
        resource_budget = _Budget(limits, rwhere + ".resource.attributes")
        resource_attrs = _json_attributes(_list(resource, "attributes", rwhere + ".resource"),
                                          rwhere + ".resource.attributes", resource_budget)
        for s, ss in enumerate(_list(rs, "scopeSpans", rwhere)):
            swhere = f"{rwhere}.scopeSpans[{s}]"
            ss = _object(ss, swhere)
            for i, span in enumerate(_list(ss, "spans", swhere)):
                where = f"{swhere}.spans[{i}]"
                span = _object(span, where)
                budget = _Budget(limits, where)
                budget.count = resource_budget.count
                name = _get(span, "name", "")
                if not isinstance(name, str):
                    raise OtlpError("must be a string", where=where + ".name")
                status = _object(_get(span, "status") or {}, where + ".status")
                message = _get(status, "message", "") or ""
                if not isinstance(message, str):
                    raise OtlpError("must be a string", where=where + ".status.message")
                events = []
                for k, e in enumerate(_list(span, "events", where)):
                    ewhere = f"{where}.events[{k}]"
                    e = _object(e, ewhere)
                    ename = _get(e, "name", "")
                    if not isinstance(ename, str):
                        raise OtlpError("must be a string", where=ewhere + ".name")
                    events.append(SpanEvent(
                        ename, _int(_get(e, "timeUnixNano", 0), ewhere + ".timeUnixNano"),
                        _json_attributes(_list(e, "attributes", ewhere),
                                         ewhere + ".attributes", budget)))
                spans.append(_span(
                    where,
                    trace_id=str(_json_hex(_get(span, "traceId"), 16, where + ".traceId")),
                    span_id=str(_json_hex(_get(span, "spanId"), 8, where + ".spanId")),
                    parent=_json_hex(_get(span, "parentSpanId"), 8, where + ".parentSpanId",
                                     optional=True),
                    name=name,
                    start=_int(_get(span, "startTimeUnixNano", 0),
                               where + ".startTimeUnixNano"),
                    end=_int(_get(span, "endTimeUnixNano", 0), where + ".endTimeUnixNano"),
                    attributes=_json_attributes(_list(span, "attributes", where),
                                                where + ".attributes", budget),
                    events=events,
                    status=_json_enum(_get(status, "code"), _STATUS_NAMES,
                                      where + ".status.code"),
                    message=message, resource=resource_attrs))
    return spans
