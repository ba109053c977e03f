"""A request's output constraint: OpenAI's ``response_format`` or vLLM's ``structured_outputs``.

``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``, or
``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``.
``structured_outputs``: vLLM's object, ``{"json" | "regex" | "choice" | "grammar" |
"json_object": ...}`` plus its options. A bad one is a 400 naming the field the client used, and
the grammar is checked here, before the request reaches the engine.

What ``json_schema.strict`` means here: unset or true, the schema is generated as OpenAI's
strict mode (and vLLM's default backend, xgrammar) generates it, with only the properties each
object declares unless it allows others explicitly (structured_output/strict_schema.py), since
a small model otherwise invents keys until max_tokens; an explicit ``"strict": false`` asks
for the schema's plain JSON Schema reading, undeclared keys allowed. OpenAI's strict mode also
refuses schemas it cannot enforce; pagedllm enforces a wider set, so it does not.
vLLM's ``structured_outputs.json`` keeps its plain JSON Schema reading (as vLLM's guidance
backend does): a client who wants it closed says ``additionalProperties: false``.
"""
from __future__ import annotations

from typing import Any

from pagedllm.errors import ValidationError
from pagedllm.structured_output.grammar import grammar_source
from pagedllm.structured_output.strict_schema import strict_schema
from pagedllm.structured_outputs_params import StructuredOutputsParams

_OPTIONS = ("disable_any_whitespace", "whitespace_pattern")
_FIELDS = ("json", "regex", "choice", "grammar", "json_object", *_OPTIONS)


def structured_outputs_params(response_format: Any, structured_outputs: Any) -> StructuredOutputsParams | None:
    """The constraint of a request, or None; ValidationError naming the field if it is bad."""
    fmt = _from_response_format(response_format)
    so = _from_structured_outputs(structured_outputs)
    if fmt is not None and so is not None:
        raise ValidationError("give response_format or structured_outputs, not both", "structured_outputs")
    chosen, field = (fmt, "response_format") if fmt is not None else (so, "structured_outputs")
    if chosen is None:
        return None
    try:
        params = StructuredOutputsParams(**chosen)
        grammar_source(params)
    except ValidationError as e:
        raise ValidationError(e.message.replace("structured_outputs", field), field) from e
    return params


def _from_response_format(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ValidationError('response_format must be an object with a "type"', "response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise ValidationError('response_format json_schema needs "json_schema": {"name", "schema"}',
                                  "response_format")
        schema = spec.get("schema", spec.get("json_schema"))
        if not isinstance(schema, dict):
            raise ValidationError("response_format json_schema.schema must be a JSON schema object",
                                  "response_format")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ValidationError("response_format json_schema.strict must be true, false or null",
                                  "response_format")
        return {"json": schema if strict is False else strict_schema(schema)}
    raise ValidationError(f"response_format type {kind!r} is not supported; use text, json_object "
                          "or json_schema", "response_format")


def _from_structured_outputs(value: Any) -> dict[str, Any] | None:
    if value is None or value == {}:
        return None
    if not isinstance(value, dict):
        raise ValidationError("structured_outputs must be an object", "structured_outputs")
    unknown = sorted(k for k, v in value.items() if k not in _FIELDS and v not in (None, False))
    if unknown:
        raise ValidationError(f"structured_outputs fields {unknown} are not supported; use one of "
                              f"{', '.join(_FIELDS)}", "structured_outputs")
    return {k: v for k, v in value.items() if k in _FIELDS and v is not None}
