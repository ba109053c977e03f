"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API over the chat
handler (protocol_responses.py translates the request; this file translates the answer).

A streamed answer is the chat handler's chunk stream rewritten as the Responses event sequence:
response.created, response.in_progress, then per output item output_item.added, for a message
content_part.added, output_text.delta ..., output_text.done, content_part.done, for a function
call function_call_arguments.delta ..., function_call_arguments.done, then output_item.done, and
last response.completed (response.incomplete when max_output_tokens cut it; error and
response.failed when the engine failed)."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

import pydantic
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from pagedllm.entrypoints.openai.api_errors import APIError
from pagedllm.entrypoints.openai.protocol import OpenAIBaseModel
from pagedllm.entrypoints.openai.protocol_responses import (
    CHAT_TO_RESPONSES_PARAM,
    FunctionCallItem,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    from_chat,
    item_id,
    make_response_usage,
    mark_finished,
    new_response,
)
from pagedllm.entrypoints.openai.response_store import ResponseStore
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.errors import ValidationError


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.store = store if store is not None else ResponseStore()

    async def create_response(self, request: ResponsesRequest, raw_request: Request) -> Any:
        self.chat.check_model(request.model)
        request.check_extra_fields()
        request.check()
        history = self._history(request.previous_response_id)
        response = new_response(request, item_id("resp"), self.chat.model_name)
        try:
            chat_request = request.chat_request(history)
            result = await self.chat.create_chat_completion(chat_request, raw_request)
        except pydantic.ValidationError as e:  # an item or tool the chat API's shapes refuse
            first = e.errors()[0]
            field = str(first["loc"][0]) if first.get("loc") else "input"
            raise ValidationError(f"{field}: {first.get('msg')}", CHAT_TO_RESPONSES_PARAM.get(field, field)) from e
        except ValidationError as e:  # name the field as this request spelled it
            e.param = CHAT_TO_RESPONSES_PARAM.get(e.param, e.param) if e.param else e.param
            raise
        conversation = history + request.input_items()
        if isinstance(result, StreamingResponse):
            return StreamingResponse(self._stream(response, result.body_iterator, conversation),
                                     media_type="text/event-stream")
        from_chat(response, result)
        self._store(response, conversation)
        return response

    def retrieve(self, response_id: str) -> ResponseObject:
        stored = self.store.get(response_id)
        if stored is None:
            raise APIError(404, f"no stored response with id {response_id!r} (responses are kept "
                                "only with store: true, and the oldest are dropped)", "response_id")
        return stored.response

    def _history(self, previous_response_id: str | None) -> list[dict[str, Any]]:
        if previous_response_id is None:
            return []
        stored = self.store.get(previous_response_id)
        if stored is None:
            raise ValidationError(f"previous_response_id {previous_response_id!r} names no stored response",
                                  "previous_response_id")
        return list(stored.conversation)

    def _store(self, response: ResponseObject, conversation: list[dict[str, Any]]) -> None:
        if response.store:
            self.store.put(response, conversation + [item.model_dump() for item in response.output])

    async def _stream(self, response: ResponseObject, chunks: AsyncIterator[str],
                      conversation: list[dict[str, Any]]) -> AsyncIterator[str]:
        events = ResponseEvents(response)
        yield events.event("response.created", response=response.model_dump())
        yield events.event("response.in_progress", response=response.model_dump())
        try:
            async for frame in chunks:
                data = frame.removeprefix("data: ").strip()
                if data == "[DONE]":
                    break
                for event in events.on_chunk(json.loads(data)):
                    yield event
                if response.status == "failed":
                    return
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]  # a client gone: abort the request
        for event in events.finish():
            yield event
        self._store(response, conversation)


class ResponseEvents:
    """One response's event sequence, built from chat completion chunks (as dicts)."""

    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self.sequence_number = 0
        self.message: OutputMessage | None = None  # the message item being streamed
        self.text = ""
        self.calls: dict[int, FunctionCallItem] = {}  # by the chat delta's tool-call index
        self.open_call: FunctionCallItem | None = None
        self.finish_reason: str | None = None

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def on_chunk(self, chunk: dict[str, Any]) -> Iterator[str]:
        if "error" in chunk:
            yield from self._fail(chunk["error"])
            return
        usage = chunk.get("usage")
        if usage:
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            self.response.usage = make_response_usage(usage["prompt_tokens"], usage["completion_tokens"], cached)
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("content"):
                yield from self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or []:
                yield from self._call_delta(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def finish(self) -> Iterator[str]:
        if not self.response.output:  # an empty answer is still one (empty) message
            yield from self._open_message()
        yield from self._close_open_item()
        mark_finished(self.response, self.finish_reason)
        kind = "response.completed" if self.response.status == "completed" else "response.incomplete"
        yield self.event(kind, response=self.response.model_dump())

    def _index(self, item: OutputMessage | FunctionCallItem) -> int:
        return len(self.response.output) - 1 if self.response.output[-1] is item else self.response.output.index(item)

    def _open_message(self) -> Iterator[str]:
        self.message, self.text = OutputMessage(status="in_progress"), ""
        self.response.output.append(self.message)
        index = self._index(self.message)
        yield self.event("response.output_item.added", output_index=index, item=self.message.model_dump())
        yield self.event("response.content_part.added", item_id=self.message.id, output_index=index,
                         content_index=0, part=OutputText(text="").model_dump())

    def _text_delta(self, text: str) -> Iterator[str]:
        if self.message is None:
            yield from self._close_open_item()
            yield from self._open_message()
        assert self.message is not None
        self.text += text
        yield self.event("response.output_text.delta", item_id=self.message.id,
                         output_index=self._index(self.message), content_index=0, delta=text, logprobs=[])

    def _call_delta(self, call: dict[str, Any]) -> Iterator[str]:
        index = call.get("index", 0)
        function = call.get("function") or {}
        item = self.calls.get(index)
        if item is None:
            yield from self._close_open_item()
            item = FunctionCallItem(call_id=call.get("id") or item_id("call"), name=function.get("name") or "",
                                    arguments="", status="in_progress")
            self.calls[index] = self.open_call = item
            self.response.output.append(item)
            yield self.event("response.output_item.added", output_index=self._index(item), item=item.model_dump())
        arguments = function.get("arguments")
        if arguments:
            item.arguments += arguments
            yield self.event("response.function_call_arguments.delta", item_id=item.id,
                             output_index=self._index(item), delta=arguments)

    def _close_open_item(self) -> Iterator[str]:
        if self.message is not None:
            message, self.message = self.message, None
            index = self._index(message)
            part = OutputText(text=self.text)
            yield self.event("response.output_text.done", item_id=message.id, output_index=index,
                             content_index=0, text=self.text, logprobs=[])
            yield self.event("response.content_part.done", item_id=message.id, output_index=index,
                             content_index=0, part=part.model_dump())
            message.content, message.status = [part], "completed"
            yield self.event("response.output_item.done", output_index=index, item=message.model_dump())
        if self.open_call is not None:
            call, self.open_call = self.open_call, None
            index = self._index(call)
            call.status = "completed"
            yield self.event("response.function_call_arguments.done", item_id=call.id, output_index=index,
                             name=call.name, arguments=call.arguments)
            yield self.event("response.output_item.done", output_index=index, item=call.model_dump())

    def _fail(self, error: dict[str, Any]) -> Iterator[str]:
        message = str(error.get("message") or "the engine failed")
        code = str(error.get("type") or "server_error")
        self.response.status, self.response.error = "failed", {"code": code, "message": message}
        yield self.event("error", code=code, message=message, param=error.get("param"))
        yield self.event("response.failed", response=self.response.model_dump())


# What /openapi.json says POST /v1/responses answers: the response, or a stream of events.
_STREAMED: dict[int | str, dict[str, Any]] = {
    200: {"description": "The response (JSON), or with stream: true a text/event-stream of Responses events",
          "content": {"text/event-stream": {"schema": {  # one event: its type line and its JSON data
              "type": "object", "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
              "required": ["data"]}}}}}


class ResponseDeleted(OpenAIBaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


def responses_router(responses: OpenAIServingResponses) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.post("/responses", response_model=ResponseObject, responses=_STREAMED)
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Any:
        return await responses.create_response(request, raw_request)

    @router.get("/responses/{response_id}")
    async def retrieve_response(response_id: str) -> ResponseObject:
        return responses.retrieve(response_id)

    @router.delete("/responses/{response_id}")
    async def delete_response(response_id: str) -> ResponseDeleted:
        responses.retrieve(response_id)  # 404 when absent
        responses.store.delete(response_id)
        return ResponseDeleted(id=response_id)

    return router
