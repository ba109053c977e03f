"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, run by the chat
completion route (translate.py maps the request and the answer) with errors in Anthropic's shape.

A stream is the chat route's stream re-told as Anthropic's events: message_start (with the
prompt's token count), ping, then per content block content_block_start, its deltas (text_delta,
or input_json_delta for a tool_use block's arguments) and content_block_stop, and at the end
message_delta (stop_reason, output usage) and message_stop; a failure after the start is an
``error`` event."""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError

from pagedllm.entrypoints.anthropic.protocol import (
    ERROR_TYPES,
    AnthropicErrorResponse,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
    MessagesTokenCountRequest,
    anthropic_error,
    error_json,
    random_message_id,
)
from pagedllm.entrypoints.anthropic.translate import stop_reason, to_chat_request, to_message, to_usage
from pagedllm.entrypoints.openai.api_errors import exception_to_body
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.errors import ValidationError

logger = logging.getLogger("pagedllm.entrypoints.anthropic")


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


async def _parse(raw_request: Request, model: type[BaseModel]) -> Any:
    try:
        return model.model_validate_json(await raw_request.body())
    except PydanticValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise ValidationError(f"{where}: {first.get('msg')}", where) from None


class AnthropicServingMessages:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create_message(self, raw_request: Request) -> Response:
        request: MessagesRequest = await _parse(raw_request, MessagesRequest)
        request.check_extra_fields()
        result = await self.chat.create_chat_completion(to_chat_request(request, request.stream), raw_request)
        if not request.stream:
            return JSONResponse(to_message(result, request.stop_sequences).model_dump())
        return StreamingResponse(self._events(result.body_iterator, request), media_type="text/event-stream")

    async def count_tokens(self, raw_request: Request) -> CountTokensResponse:
        request: MessagesTokenCountRequest = await _parse(raw_request, MessagesTokenCountRequest)
        request.check_extra_fields()
        self.chat.check_model(request.model)
        chat_request = to_chat_request(request)
        ids = await self.chat.render_prompt(chat_request.conversation(), None, True,
                                            chat_request.template_kwargs(), chat_request.tool_dicts())
        return CountTokensResponse(input_tokens=len(ids))

    async def _events(self, chunks: AsyncIterator[str], request: MessagesRequest) -> AsyncIterator[str]:
        state = _EventStream(self.chat.model_name, request.stop_sequences)
        try:
            async for raw in chunks:
                data = raw.removeprefix("data: ").strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:  # the chat stream's error object, after the status line
                    error = chunk["error"]
                    yield _event("error", anthropic_error(error.get("code", 500), error.get("message", "")
                                                          ).model_dump(exclude={"type"}))
                    return
                for event in state.feed(chunk):
                    yield event
            for event in state.finish():
                yield event
        finally:
            await chunks.aclose()  # a client gone mid-stream aborts the engine request


class _EventStream:
    """The chat stream's chunks (one choice) -> Anthropic's events, block by block."""

    def __init__(self, model: str, stop_sequences: list[str] | None) -> None:
        self.model = model
        self.stop_sequences = stop_sequences
        self.started = False
        self.num_blocks = 0
        self.open_block: str | None = None  # "text" or "tool_use"
        self.finish_reason: str | None = None
        self.matched: int | str | None = None
        self.usage: dict[str, Any] = {}

    def feed(self, chunk: dict[str, Any]) -> list[str]:
        events: list[str] = []
        if not self.started:
            self.started = True
            num_prompt = len(chunk.get("prompt_token_ids") or [])
            message = MessageResponse(id=random_message_id(), model=self.model,
                                      usage={"input_tokens": num_prompt, "output_tokens": 0})
            events += [_event("message_start", {"message": message.model_dump()}),
                       _event("ping", {})]
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._open("text", {"type": "text", "text": ""})
                events.append(_event("content_block_delta", {"index": self.num_blocks - 1, "delta": {
                    "type": "text_delta", "text": delta["content"]}}))
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                if call.get("id"):  # a new call: its own block
                    events += self._open("tool_use", {"type": "tool_use", "id": call["id"],
                                                      "name": function.get("name"), "input": {}}, new=True)
                if function.get("arguments"):
                    events.append(_event("content_block_delta", {"index": self.num_blocks - 1, "delta": {
                        "type": "input_json_delta", "partial_json": function["arguments"]}}))
            if choice.get("finish_reason"):
                self.finish_reason, self.matched = choice["finish_reason"], choice.get("stop_reason")
        return events

    def _open(self, kind: str, block: dict[str, Any], new: bool = False) -> list[str]:
        if self.open_block == kind and not new:
            return []
        events = self._close()
        self.open_block = kind
        self.num_blocks += 1
        return events + [_event("content_block_start", {"index": self.num_blocks - 1, "content_block": block})]

    def _close(self) -> list[str]:
        if self.open_block is None:
            return []
        self.open_block = None
        return [_event("content_block_stop", {"index": self.num_blocks - 1})]

    def finish(self) -> list[str]:
        events = self._close()
        reason, sequence = stop_reason(self.finish_reason, self.matched, self.stop_sequences)
        usage = to_usage(self.usage).model_dump()
        events.append(_event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                               "usage": usage}))
        return events + [_event("message_stop", {})]


# The API description names Anthropic's error object for these routes (the app's default is OpenAI's).
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": AnthropicErrorResponse, "description": kind} for code, kind in ERROR_TYPES.items()
    if code in (400, 401, 404, 408, 413, 503)}


def messages_router(chat: OpenAIServingChat) -> APIRouter:
    """The two routes; every error they raise is answered in Anthropic's error shape."""
    router = APIRouter()
    messages = AnthropicServingMessages(chat)

    async def answer(work: Any) -> Any:
        try:
            return await work
        except Exception as e:  # noqa: BLE001 - every failure as Anthropic's error object
            body = exception_to_body(e)
            if body.error.code >= 500:
                logger.exception("the Messages API failed")
            return error_json(body.error.code, body.error.message)

    @router.post("/v1/messages", response_model=None, responses=_ERRORS)
    async def create_message(raw_request: Request) -> Response:
        return await answer(messages.create_message(raw_request))

    @router.post("/v1/messages/count_tokens", response_model=None, responses=_ERRORS)
    async def count_tokens(raw_request: Request) -> Any:
        return await answer(messages.count_tokens(raw_request))

    return router
