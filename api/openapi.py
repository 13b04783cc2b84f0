"""The OpenAPI document: FastAPI's, plus the schema of every event type, so that the batch
append's ``events`` items are described exactly (a ``oneOf`` on ``type``)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import GenerateJsonSchema

from store.events import EVENT_TYPES

__all__ = ["event_schemas", "install_openapi"]

#: OpenAPI links: what a created run or episode leads to (for clients and stateful tests).
_LINKS: dict[tuple[str, str, str], dict[str, tuple[str, str, str]]] = {
    ("post", "/v1/runs", "201"): {
        "GetRun": ("get", "/v1/runs/{run_id}", "run_id"),
        "StartEpisode": ("post", "/v1/runs/{run_id}/episodes", "run_id"),
    },
    ("post", "/v1/runs/{run_id}/episodes", "201"): {
        "GetEpisode": ("get", "/v1/episodes/{episode_id}", "episode_id"),
        "AppendEvents": ("post", "/v1/episodes/{episode_id}/events", "episode_id"),
        "GetTimelines": ("get", "/v1/episodes/{episode_id}/timelines", "episode_id"),
    },
}

_TOKENS = {"anyOf": [{"type": "array", "items": {"type": "number"}},
                     {"type": "string", "description": "base64 of little-endian int32 ids "
                                                       "or float32 logprobs"}]}


_PROMPT_REF = {
    "type": "object", "additionalProperties": False, "required": ["extends"],
    "description": "The prompt of an earlier llm_called of the batch (event `extends`) "
                   "followed by its response ids, cut to `keep` tokens, then `suffix`.",
    "properties": {"extends": {"type": "integer", "minimum": 0},
                   "keep": {"type": "integer", "minimum": 0},
                   "suffix": {"anyOf": [{"type": "array", "items": {"type": "integer"}},
                                        {"type": "string"}]}},
}


class _TokenArrays(GenerateJsonSchema):
    """Token payloads are numpy arrays in the store; over HTTP a list or base64 text."""

    def is_instance_schema(self, schema: Any) -> dict[str, Any]:
        return dict(_TOKENS)


def event_schemas() -> tuple[dict[str, Any], dict[str, Any]]:
    """``(schemas by component name, their $defs)`` of every event type, each with its
    ``type`` constant required."""
    schemas: dict[str, Any] = {}
    defs: dict[str, Any] = {}
    for name, cls in sorted(EVENT_TYPES.items()):
        js = cls.model_json_schema(ref_template="#/components/schemas/{model}",
                                   schema_generator=_TokenArrays)
        defs.update(js.pop("$defs", {}))
        js["properties"] = {"type": {"type": "string", "const": name, "enum": [name]},
                            **js.get("properties", {})}
        js["required"] = ["type", *js.get("required", [])]
        js["title"] = f"{cls.__name__}Event"
        if "prompt_ids" in js.get("properties", {}) and name == "llm_called":
            js["properties"]["prompt_ids"] = {"anyOf": [*_TOKENS["anyOf"], _PROMPT_REF]}
        schemas[f"{cls.__name__}Event"] = js
    return schemas, defs


def install_openapi(app: FastAPI) -> None:
    """Make ``app.openapi()`` describe event types in the append request."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        document = get_openapi(title=app.title, version=app.version,
                               description=app.description, routes=app.routes)
        components = document.setdefault("components", {}).setdefault("schemas", {})
        schemas, defs = event_schemas()
        for name, schema in defs.items():
            components.setdefault(name, schema)
        components.update(schemas)
        append = components.get("AppendRequest")
        if append is not None:
            refs = [{"$ref": f"#/components/schemas/{name}"} for name in schemas]
            append["properties"]["events"]["items"] = {
                "oneOf": refs,
                "discriminator": {"propertyName": "type", "mapping": {
                    s["properties"]["type"]["const"]: f"#/components/schemas/{name}"
                    for name, s in schemas.items()}},
            }
        _add_links(document)
        app.openapi_schema = document
        return document

    app.openapi = openapi  # type: ignore[method-assign]


def _add_links(document: dict[str, Any]) -> None:
    """Add ``_LINKS`` to the responses that create runs and episodes (a link whose source or
    target operation is missing is left out)."""
    paths = document.get("paths", {})
    for (method, path, status), links in _LINKS.items():
        response = paths.get(path, {}).get(method, {}).get("responses", {}).get(status)
        if response is None:
            continue
        out = response.setdefault("links", {})
        for name, (target_method, target_path, parameter) in links.items():
            target = paths.get(target_path, {}).get(target_method)
            if target is None or "operationId" not in target:
                continue
            out[name] = {"operationId": target["operationId"],
                         "parameters": {parameter: f"$response.body#/{parameter}"}}
