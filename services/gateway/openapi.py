"""The OpenAPI document, generated from :data:`rest.OPERATIONS` and the msgspec types.

Answers are exact: every field of an answer the gateway writes is ``required`` (it is
always sent, ``null`` or not) unless its type leaves defaults out; tags are typed strings;
the headers an answer carries are declared."""

from __future__ import annotations

import types as pytypes
import typing
from typing import Any

import msgspec

from sbx_api.hostapi import MEDIA_TYPE as FRAMES
from services.gateway import archive, hostapi, rest, schemas, snapshots, timeline

REF = "#/components/schemas/{name}"
BYTES = {"type": "string", "format": "binary"}


# Long on purpose: the document is one literal.
def document(version: str) -> dict[str, Any]:
    types: list[Any] = [schemas.Health]
    operations = (
        *rest.OPERATIONS,
        *snapshots.OPERATIONS,
        *hostapi.OPERATIONS,
        *archive.OPERATIONS,
        *timeline.OPERATIONS,
    )
    for op in operations:
        if op.body is not None:
            types.append(op.body)
        types.extend(t for t, _ in op.responses.values() if t is not None)
        types.extend(t for _, t in op.answer_media if t is not None)
    unique = list(dict.fromkeys(types))
    refs, components = msgspec.json.schema_components(unique, ref_template=REF)
    ref_of = dict(zip(unique, refs, strict=True))
    for t, ref in ref_of.items():  # rules across fields a type states itself (e.g. "one of")
        if (extra := getattr(t, "JSON_SCHEMA_EXTRA", None)) is not None:
            components[ref["$ref"].rsplit("/", 1)[1]].update(extra)
    answers = [t for op in operations for t, _ in op.responses.values()]
    answers += [t for op in operations for _, t in op.answer_media]
    exact_answers(components, [schemas.Health, *answers])

    paths: dict[str, dict[str, Any]] = {}
    for op in operations:
        entry: dict[str, Any] = {
            "operationId": op.operation_id,
            "summary": op.summary,
            "tags": [op.tag],
            "parameters": [
                {
                    "name": p.name,
                    "in": p.where,
                    "description": p.description,
                    "required": p.required or p.where == "path",
                    "schema": p.schema,
                }
                for p in op.params
            ],
            "responses": {
                str(status): {
                    "description": description,
                    **({"content": {"application/json": {"schema": ref_of[t]}}} if t is not None else {}),
                }
                for status, (t, description) in sorted(op.responses.items())
            },
        }
        success = entry["responses"][str(min(op.responses))]
        if op.answer_media:
            success["content"] = {
                media_type: {"schema": ref_of[t] if t is not None else BYTES}
                for media_type, t in op.answer_media
            }
        if op.answer_headers:
            success["headers"] = {name: _header(name, required=True) for name in op.answer_headers}
        for status, (t, _) in op.responses.items():
            if t is schemas.Problem:
                entry["responses"][str(status)]["headers"] = {"Retry-After": _header("Retry-After")}
        if op.body is not None:
            entry["requestBody"] = {
                "required": not op.body_optional,
                "content": {"application/json": {"schema": ref_of[op.body]}},
            }
        elif op.body_media_type is not None:
            entry["requestBody"] = {
                "required": True,
                "content": {
                    op.body_media_type: {
                        # (at least one frame: a header is 5 bytes)
                        "schema": {**BYTES, "minLength": 5} if op.body_media_type == FRAMES else BYTES
                    }
                },
            }
        paths.setdefault(op.path, {})[op.method.lower()] = entry
    paths["/healthz"] = {
        "get": {
            "operationId": "health",
            "summary": "Liveness of this gateway instance (no key needed)",
            "tags": ["operations"],
            "security": [],
            "responses": {
                "200": {
                    "description": "Serving.",
                    "content": {"application/json": {"schema": ref_of[schemas.Health]}},
                },
                "503": {"description": "Draining or starting."},
            },
        }
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Cloud Agent Sandbox control plane",
            "version": version,
            "description": (
                "Session registry and the host API (streamed exec and file transfer for the "
                "agent-host client). Every call needs `Authorization: Bearer <SANDBOX_API_KEY>`."
            ),
        },
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"apiKey": []}],
    }


def _header(name: str, *, required: bool = False) -> dict[str, Any]:
    description, schema = rest.HEADERS[name]
    return {"description": description, "required": required, "schema": schema}


def exact_answers(components: dict[str, Any], answers: list[Any]) -> None:
    """Mark every field of the answers' structs (and the structs they hold) required,
    unless the struct leaves defaults out; give enum-only string properties their type."""
    seen: set[type] = set()
    pending = [t for t in answers if t is not None]
    while pending:
        kind = pending.pop()
        if isinstance(kind, pytypes.UnionType) or typing.get_origin(kind) is not None:
            pending += [a for a in typing.get_args(kind) if a is not type(None)]
            continue
        if not (isinstance(kind, type) and issubclass(kind, msgspec.Struct)) or kind in seen:
            continue
        seen.add(kind)
        schema = components.get(kind.__name__)
        if schema is None:
            continue
        if not kind.__struct_config__.omit_defaults:
            schema["required"] = list(schema.get("properties", {}))
        for field in msgspec.structs.fields(kind):
            pending.append(field.type)
    for schema in components.values():
        for prop in schema.get("properties", {}).values():
            if "enum" in prop and "type" not in prop and all(isinstance(v, str) for v in prop["enum"]):
                prop["type"] = "string"
