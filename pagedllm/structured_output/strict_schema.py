"""A JSON schema read as OpenAI's strict mode reads it: an object has the properties it declares
and no others.

JSON Schema itself lets an object carry any key its schema does not mention unless
``additionalProperties`` says otherwise, and llguidance follows it, so a small model writing
tool arguments for ``{"properties": {"city": ...}}`` may invent keys until max_tokens. OpenAI's
strict mode (and vLLM's default backend, xgrammar) generates only the declared keys; this copy
of a schema says so explicitly, which every backend understands.

Which objects are closed: every (sub)schema that lists ``properties`` and says nothing of
``additionalProperties`` / ``unevaluatedProperties``. One that lists no properties asks for any
object (``{"type": "object"}``, as response_format json_object does) and stays open; a schema
that allows extra keys explicitly keeps them. ``allOf`` members are left open at their own
level: their properties add up, and closing each would let no object satisfy them all.
"""
from __future__ import annotations

from typing import Any

# Keywords whose value is one subschema, a list of them, or a name -> subschema map.
_ONE = ("additionalProperties", "items", "contains", "not", "if", "then", "else",
        "propertyNames", "unevaluatedItems", "additionalItems")
_LIST = ("anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def strict_schema(schema: Any) -> Any:
    """A copy of ``schema`` with every object that declares properties closed to others."""
    return _close(schema, close_here=True)


def _close(schema: Any, close_here: bool) -> Any:
    if not isinstance(schema, dict):
        return schema  # true / false schemas, or what the grammar check will refuse
    out = dict(schema)
    if (close_here and isinstance(out.get("properties"), dict) and "allOf" not in out
            and "additionalProperties" not in out and "unevaluatedProperties" not in out):
        out["additionalProperties"] = False
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = _close(out[key], True)
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [_close(s, True) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(s, True) for name, s in out[key].items()}
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_close(s, False) for s in out["allOf"]]
    return out
