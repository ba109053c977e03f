"""Anthropic Messages API bodies: the request of POST /v1/messages (and of count_tokens), the
Message it answers, its stream events and the error object, with Anthropic's field names.

Content blocks stay plain dicts here: translate.py reads them and says in a 400 which block it
cannot take. Unknown request fields (``metadata``, ``thinking``, ``service_tier``, ...) are
accepted and logged once, as on the OpenAI routes."""
from __future__ import annotations

import uuid
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from pagedllm.entrypoints.openai.request_base import OpenAIRequest


def random_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesTokenCountRequest(OpenAIRequest):
    """POST /v1/messages/count_tokens: what the prompt is made of."""
    model: str
    messages: list[AnthropicMessage]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None


class MessagesRequest(MessagesTokenCountRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None


class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int | None = None


class MessageResponse(BaseModel):
    id: str = Field(default_factory=random_message_id)
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]] = Field(default_factory=list)  # text and tool_use blocks
    stop_reason: str | None = None  # end_turn, max_tokens, stop_sequence, tool_use
    stop_sequence: str | None = None
    usage: AnthropicUsage


class CountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorInfo


# HTTP status -> Anthropic's error type (their documented table).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error(status: int, message: str) -> AnthropicErrorResponse:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")
    return AnthropicErrorResponse(error=AnthropicErrorInfo(type=kind, message=message))


def error_json(status: int, message: str) -> JSONResponse:
    return JSONResponse(anthropic_error(status, message).model_dump(), status_code=status)
