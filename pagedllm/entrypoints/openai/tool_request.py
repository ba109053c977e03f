"""A chat request's tools: the checks of ``tools`` / ``tool_choice`` (400s naming the field,
with vLLM's messages), and the JSON schema that enforces a forced tool call.

``tool_choice: "required"`` is generated under an array of ``{"name", "parameters"}`` objects,
one branch per tool, so the model can only call a function the request offers, with arguments
its schema accepts; a named function is generated under its own parameters' schema. The schema
goes through the structured-output machinery like any response_format, so the arguments always
parse (unless max_tokens cuts the reply short). Arguments are generated as OpenAI's strict mode
generates them, whatever the tool's ``strict`` says: only the declared properties, unless a
schema allows others explicitly (structured_output/strict_schema.py), since a function called
with a key it does not take fails; and with at most one space between JSON tokens, whatever the
engine's whitespace default (models write calls on one line).
"""
from __future__ import annotations

import copy
from typing import Any

from pagedllm.errors import ValidationError
from pagedllm.structured_output.grammar import ONE_SPACE, grammar_source
from pagedllm.structured_output.strict_schema import strict_schema
from pagedllm.structured_outputs_params import StructuredOutputsParams

_AUTO_NEEDS_FLAGS = ('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                     "to be set")
# An omitted or null schema: OpenAI's "no parameters", generated as {}.
_NO_PARAMETERS = {"type": "object", "properties": {}}


def check_tool_usage(request: Any, auto_tool_choice: bool) -> str:
    """The request's tool choice ("none", "auto", "required", "named") once its fields agree;
    ``auto_tool_choice``: the server runs a tool-call parser."""
    choice = request.effective_tool_choice()
    if choice != "none" and request.tool_choice is not None and request.tools is None:
        raise ValidationError("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice == "required" and not request.tools:
        return "none"  # an empty tools list: OpenAI answers as if no tool was offered
    if choice == "named":
        name = request.tool_choice.function.name
        if name not in {t.function.name for t in request.tools}:
            raise ValidationError(f"The tool specified in `tool_choice` ({name!r}) does not match any "
                                  "of the specified `tools`", "tool_choice")
    if choice == "auto" and not auto_tool_choice:
        raise ValidationError(_AUTO_NEEDS_FLAGS, "tool_choice")
    names = [t.function.name for t in request.tools or []]
    if len(set(names)) != len(names):
        raise ValidationError("tools must have distinct function names", "tools")
    return choice


def tool_structured_outputs(request: Any) -> StructuredOutputsParams | None:
    """The constraint of a forced tool call, or None (none, auto, or no tools)."""
    choice = request.effective_tool_choice()
    if not request.tools or choice in ("none", "auto"):
        return None
    if choice == "named":
        tool = next((t for t in request.tools if t.function.name == request.tool_choice.function.name), None)
        if tool is None:
            return None  # check_tool_usage reports it
        schema = tool.function.parameters or _NO_PARAMETERS
    else:
        schema = required_schema(request.tools, request.parallel_tool_calls is not False)
    try:
        params = StructuredOutputsParams(json=strict_schema(schema), whitespace_pattern=ONE_SPACE)
        grammar_source(params)
    except ValidationError as e:
        raise ValidationError(e.message.replace("structured_outputs.json", "a tool's parameters"),
                              "tools") from e
    return params


def required_schema(tools: list[Any], parallel: bool) -> dict[str, Any]:
    """One or more calls of the given tools; a single call without parallel_tool_calls."""
    branches, defs = [], {}
    for tool in tools:
        parameters = copy.deepcopy(tool.function.parameters) or dict(_NO_PARAMETERS)
        # "#/$defs/..." references resolve at the root: lift each tool's $defs there.
        tool_defs = parameters.pop("$defs", {})
        if not isinstance(tool_defs, dict):
            raise ValidationError(f"tool {tool.function.name!r}: $defs must be an object", "tools")
        for name, definition in tool_defs.items():
            if name in defs and defs[name] != definition:
                raise ValidationError(f"tools define $defs {name!r} differently; one schema holds "
                                      "them all, so the names must be distinct", "tools")
            defs[name] = definition
        branches.append({"type": "object",
                         "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                        "parameters": parameters},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": branches[0] if len(branches) == 1 else {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema
