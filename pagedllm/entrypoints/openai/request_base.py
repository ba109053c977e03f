"""What every request body shares: unknown fields accepted and logged (vLLM's behaviour), fields
with a meaning pagedllm cannot honour refused, and text and numbers checked before anything
reaches the engine.

* An unknown field (``metadata``, ``store``, ``parallel_tool_calls``, ...) is kept in
  ``model_extra``, ignored, and logged once per field name, so clients that send the whole OpenAI
  surface keep working and the log does not fill up.
* A known field whose meaning pagedllm does not implement (``tools`` on /v1/completions, chat
  declares its own; the old ``guided_*`` fields: vLLM's ``structured_outputs`` replaced them) is
  a 400 naming it: ignoring it would return the wrong kind of answer.
* NaN and infinities are refused (JSON from Python clients can carry them; NaN fails every range
  check), and so is a lone UTF-16 surrogate in any string, with the field named.
* An integer beyond 64 bits in an integer field or a token-id list (``max_tokens``, ``priority``,
  ``prompt``) is a 400 naming the field: JSON numbers have no size limit, but the executor wire
  and torch carry 64 bits, and such a value used to fail deep inside as a 500. Finer ranges
  (max_tokens against the context, say) are SamplingParams' and the scheduler's.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from pagedllm.errors import ValidationError, check_ints, check_text

logger = logging.getLogger("pagedllm.entrypoints.openai")

_logged_fields: set[str] = set()
_logged_lock = threading.Lock()


def _unset(value: Any) -> bool:
    return value is None or value == [] or value == {}


def _means_tools(value: Any) -> bool:
    return not _unset(value)


# field -> "does this value ask for something pagedllm does not do?"
_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "tools": _means_tools,
    "functions": _means_tools,
    "tool_choice": lambda v: v not in (None, "none", "auto"),
    "function_call": lambda v: v not in (None, "none", "auto"),
    "guided_json": lambda v: not _unset(v),
    "guided_regex": lambda v: not _unset(v),
    "guided_choice": lambda v: not _unset(v),
    "guided_grammar": lambda v: not _unset(v),
    "logits_processors": lambda v: not _unset(v),
}


def _plain(value: Any) -> Any:
    """Models inside a field (chat messages) as dicts, for the text check."""
    if isinstance(value, BaseModel):
        return value.model_dump()
    if isinstance(value, list) and value and isinstance(value[0], BaseModel):
        return [_plain(v) for v in value]
    return value


class OpenAIRequest(BaseModel):
    """Base of every request body."""
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    # Fields handled by a subclass although not declared on it (none here).
    _ignored_ok: ClassVar[frozenset[str]] = frozenset()

    @field_validator("*", mode="after")
    @classmethod
    def _text_is_unicode(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, (str, list, dict, BaseModel)):
            check_text(_plain(value), info.field_name or "body")
        if isinstance(value, (int, list)):  # dicts and models hold text, schemas: not token ids
            check_ints(value, info.field_name or "body")
        return value

    def check_extra_fields(self) -> None:
        """Refuse extras with a meaning pagedllm lacks; log the rest once per name."""
        extra = self.model_extra or {}
        for name, value in extra.items():
            if name in _UNSUPPORTED and _UNSUPPORTED[name](value):
                raise ValidationError(f"{name} is not supported by this server", name)
        new = [name for name in extra if name not in _logged_fields and name not in self._ignored_ok]
        if new:
            with _logged_lock:
                new = [name for name in new if name not in _logged_fields]
                _logged_fields.update(new)
            if new:
                logger.warning("The following fields were present in the request but ignored: %s "
                               "(logged once per field name)", sorted(new))
