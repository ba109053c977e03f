"""StructuredOutputsParams: what shape the generated text must have, with vLLM's field names.

Plain data, checked on creation: exactly one kind of constraint (``json``, ``regex``, ``choice``,
``grammar``, ``json_object``), each of the right type, else a :class:`ValidationError` naming the
field. Whether a schema or regex is *valid* is the grammar library's call; the engine asks it
when the request is added (pagedllm/structured_output/), so a bad one is still a 400 there.
"""
from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

from pagedllm.errors import INT64_MAX, INT64_MIN, ValidationError, check_text

_KINDS = ("json", "regex", "choice", "grammar", "json_object")
PARAM = "structured_outputs"


@dataclass
class StructuredOutputsParams:
    # A JSON schema, as a dict or its JSON text.
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    # The output is exactly one of these strings.
    choice: list[str] | None = None
    # A Lark grammar (llguidance's dialect), or GBNF/EBNF (``root ::= ...``, as llama.cpp and
    # xgrammar write it), converted to Lark.
    grammar: str | None = None
    # Any JSON object (OpenAI's response_format {"type": "json_object"}).
    json_object: bool | None = None
    # vLLM's option. True: JSON without whitespace between tokens; False: any whitespace JSON
    # allows (vLLM's default); None (unset): the engine's structured_outputs_config, else at most
    # one space between tokens: a small model given JSON's own rule may emit newlines until
    # max_tokens cuts its JSON off.
    disable_any_whitespace: bool | None = None
    # The whitespace allowed between JSON tokens (a regex), instead of JSON's own.
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValidationError(
                f"{PARAM} needs exactly one of {', '.join(_KINDS)}; got "
                f"{', '.join(given) if given else 'none'}", PARAM)
        if isinstance(self.json, str):
            try:
                self.json = _json.loads(self.json)
            except ValueError as e:
                raise ValidationError(f"{PARAM}.json is not valid JSON: {e}", PARAM) from e
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValidationError(f"{PARAM}.json must be a JSON schema (an object), got "
                                  f"{type(self.json).__name__}", PARAM)
        if _has_wide_int(self.json):  # the executor wire carries the schema: 64-bit integers
            raise ValidationError(f"{PARAM}.json holds an integer beyond 64 bits; write it as a "
                                  "number with an exponent (1e30) or a smaller bound", PARAM)
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or value == ""):
                raise ValidationError(f"{PARAM}.{name} must be a non-empty string", PARAM)
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or any(not isinstance(c, str) or c == "" for c in self.choice)):
                raise ValidationError(f"{PARAM}.choice must be a non-empty list of non-empty strings",
                                      PARAM)
            self.choice = list(self.choice)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValidationError(f"{PARAM}.json_object must be true or false", PARAM)
        if self.disable_any_whitespace is not None and not isinstance(self.disable_any_whitespace, bool):
            raise ValidationError(f"{PARAM}.disable_any_whitespace must be true, false or null", PARAM)
        check_text([self.regex, self.grammar, self.choice, self.whitespace_pattern], PARAM)

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, spec): what the compiled-grammar cache is keyed by; equal constraints (a schema
        with its keys in another order, say) share one compiled grammar."""
        kind = self.kind
        spec: Any = getattr(self, kind)
        text = spec if isinstance(spec, str) else _json.dumps(spec, sort_keys=True)
        if kind in ("json", "json_object"):
            text += f"|ws={self.disable_any_whitespace}:{self.whitespace_pattern}"
        return kind, text


def _has_wide_int(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, int) and not isinstance(item, bool) and not INT64_MIN <= item <= INT64_MAX:
            return True
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return False
