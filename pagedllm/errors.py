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
