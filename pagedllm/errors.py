"""Errors that pagedllm raises on purpose.

User mistakes raise :class:`ValidationError` (the server maps it to HTTP 400); nothing in the
engine uses ``assert`` for user input.
"""
from __future__ import annotations


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
