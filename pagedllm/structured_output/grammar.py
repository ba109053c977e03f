"""From StructuredOutputsParams to an llguidance grammar, checked without a tokenizer.

The check parses the grammar (a JSON schema's keywords, a regex's syntax, a Lark grammar's rules)
in a millisecond or so, which is cheap enough for ``add_request``: a bad constraint is a
ValidationError (HTTP 400) naming ``structured_outputs`` there, not a request that fails later in
the compile threads.
"""
from __future__ import annotations

import json
from typing import Any

from pagedllm.errors import ValidationError
from pagedllm.structured_outputs_params import PARAM, StructuredOutputsParams

# The whitespace allowed between JSON tokens unless a request says otherwise: at most one space.
# Models write JSON on one line (json.dumps' style or compact), and JSON's own rule (any run of
# spaces, tabs and newlines) lets a weak model spend max_tokens on whitespace between two tokens,
# so the reply is cut off and never parses. Tool calls use it too (tool_request.py).
ONE_SPACE = "[ ]?"


def llguidance() -> Any:
    """The library, imported on first use (import pagedllm never pays for it)."""
    try:
        import llguidance as llg
    except ImportError as e:  # an install without it: say how to get it
        raise ValidationError("structured outputs need the llguidance package "
                              "(pip install llguidance)", PARAM) from e
    return llg


def grammar_source(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) for ``params``; ValidationError if it is bad."""
    llg = llguidance()
    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            schema: Any = params.json if kind == "json" else {"type": "object"}
            source = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                             defaults=_json_whitespace(params))
        elif kind == "regex":
            source = llg.LLMatcher.grammar_from_regex(params.regex)
        elif kind == "choice":
            # Lark string literals take JSON's escapes, so any choice text is quoted exactly.
            source = llg.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in params.choice))
        else:
            source = llg.LLMatcher.grammar_from_lark(_to_lark(params.grammar))
    except (ValueError, TypeError) as e:
        raise ValidationError(f"{PARAM}.{kind} is invalid: {e}", PARAM) from e
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(source)
    if is_error:
        raise ValidationError(f"{PARAM}.{kind} is invalid: {_first_line(messages[0])}", PARAM)
    if kind == "json" and messages:
        # Unsupported schema keywords come back as warnings; ignoring one would let through
        # output that does not validate, so refuse them as vLLM does.
        raise ValidationError(f"{PARAM}.json uses what pagedllm cannot enforce: "
                              f"{_first_line(messages[0])}", PARAM)
    return source


def _json_whitespace(params: StructuredOutputsParams) -> dict[str, Any]:
    """llguidance's whitespace options: ``whitespace_pattern`` if given; else vLLM's
    ``disable_any_whitespace``: True, none (compact JSON); False, any that JSON allows (vLLM's
    default); unset, at most one space (ONE_SPACE)."""
    if params.whitespace_pattern is not None:
        return {"whitespace_pattern": params.whitespace_pattern}
    if params.disable_any_whitespace is None:
        return {"whitespace_pattern": ONE_SPACE}
    return {"whitespace_flexible": not params.disable_any_whitespace}


def _to_lark(grammar: str) -> str:
    """GBNF/EBNF (``root ::= ...``) to Lark; Lark as is."""
    if "::=" not in grammar:
        return grammar
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return gbnf_to_lark(grammar)
    except Exception as e:  # noqa: BLE001 - the converter raises plain Exceptions on bad input
        raise ValidationError(f"{PARAM}.grammar is not valid GBNF: {e}", PARAM) from e


def _first_line(message: str) -> str:
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return "; ".join(lines[:4])
