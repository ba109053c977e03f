"""Errors that pagedllm raises on purpose.

User mistakes raise :class:`ValidationError` (the server maps it to HTTP 400); nothing in the
engine uses ``assert`` for user input.
"""
from __future__ import annotations

from collections.abc import Container


class PagedLLMError(Exception):
    """Base class of every error pagedllm raises on purpose."""


class ValidationError(PagedLLMError, ValueError):
    """Bad user input: the message says what to change. ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class UnsupportedModelError(ValidationError):
    """The model folder names an architecture that pagedllm cannot run."""


class ModelLoadError(PagedLLMError):
    """The model folder is incomplete or inconsistent (missing weights, bad shapes)."""


class EngineDeadError(PagedLLMError):
    """The engine loop crashed; every pending request fails with this error."""


def check_request_id_free(request_id: str, *in_use: Container[str]) -> None:
    """Raise ValidationError unless ``request_id`` is free in every table of open ids given: a
    request id names one open request (its outputs, its stream, its sequences)."""
    if any(request_id in ids for ids in in_use):
        raise ValidationError(f"request id {request_id!r} is already in use", "request_id")


def check_text(value: object, param: str) -> None:
    """Raise ValidationError if a string anywhere in ``value`` (a str, or lists and dicts of
    them) holds a lone UTF-16 surrogate such as "\\ud800": JSON can carry one, but it is not
    text, and the tokenizer would fail on it with a TypeError deep inside."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValidationError(f"{param} holds a lone surrogate ({item[e.start]!r} at "
                                      f"character {e.start}): it is not valid Unicode text", param) from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


# The integers the executor wire (msgpack) and torch's int64 tensors carry: every integer a
# request gives is checked against this range at the edge, so none fails later as a 500.
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1


def check_int(value: object, param: str) -> None:
    """Raise ValidationError naming ``param`` unless ``value`` is an integer (not a bool) of 64
    bits at most."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError(f"{param} must be an integer, got {value!r}", param)
    check_ints(value, param)


def _shown(value: object) -> str:
    if isinstance(value, int) and abs(value) >= 10 ** 24:  # not a page of digits in the log
        return f"an integer of {len(str(abs(value)))} digits"
    return repr(value)


def check_ints(value: object, param: str) -> None:
    """Raise ValidationError naming ``param`` if an integer in ``value`` (an int, or lists of
    them: token ids) needs more than 64 bits; other values are left to their own checks."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, int) and not isinstance(item, bool):
            if not INT64_MIN <= item <= INT64_MAX:
                where = "is" if item is value else "holds"
                raise ValidationError(f"{param} {where} {_shown(item)}, outside the 64-bit range "
                                      f"[-2**63, 2**63 - 1] that the engine carries", param)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
