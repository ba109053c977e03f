"""Messages API <-> chat completions: a Messages request becomes the chat request the chat route
runs (the same template, sampling, structured outputs and tool parsers), and its answer becomes
a Message.

Mapping: ``system`` -> a system message; a user turn's ``tool_result`` blocks -> ``tool``
messages (before the turn's text, as the results answer the previous calls); an assistant turn's
``tool_use`` blocks -> its ``tool_calls``; ``tools`` -> function tools (``input_schema`` ->
``parameters``); ``tool_choice`` auto / any / tool / none -> auto / required / the named
function / none, ``disable_parallel_tool_use`` -> ``parallel_tool_calls: false``;
``stop_sequences`` -> ``stop``. ``thinking`` and ``redacted_thinking`` blocks of earlier turns
are dropped (the engine produced no such thing); images and documents are refused."""
from __future__ import annotations

import json
from typing import Any, ClassVar

from pydantic import ValidationError as PydanticValidationError

from pagedllm.entrypoints.anthropic.protocol import AnthropicUsage, MessageResponse, MessagesTokenCountRequest
from pagedllm.entrypoints.openai.protocol_chat import ChatCompletionRequest, ChatCompletionResponse
from pagedllm.errors import ValidationError

_DROPPED_BLOCKS = ("thinking", "redacted_thinking")
# OpenAI's finish_reason -> Anthropic's stop_reason ("stop" is end_turn or stop_sequence).
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


class MessagesChatRequest(ChatCompletionRequest):
    """A chat request made from a Messages request: Anthropic's max_tokens is an upper bound
    (clients such as Claude Code send 32000 whatever the model's context), so a longer one is
    cut to the room the prompt leaves instead of refused."""
    max_tokens_is_bound: ClassVar[bool] = True


def to_chat_request(request: MessagesTokenCountRequest, stream: bool = False) -> ChatCompletionRequest:
    """The chat completion request a Messages request means (count_tokens' has no sampling)."""
    body: dict[str, Any] = {"model": request.model, "messages": _chat_messages(request)}
    if request.tools:
        body["tools"] = [_chat_tool(t, i) for i, t in enumerate(request.tools)]
    body.update(_tool_choice(request.tool_choice))
    if hasattr(request, "max_tokens"):
        body.update(max_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p,
                    top_k=request.top_k, stop=request.stop_sequences or None)
    if stream:  # usage at the end; the prompt's ids in the first chunk give message_start its count
        body.update(stream=True, stream_options={"include_usage": True}, return_token_ids=True)
    try:
        return MessagesChatRequest.model_validate(body)
    except PydanticValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise ValidationError(f"{where}: {first.get('msg')}", str(first.get("loc", ("body",))[0])) from None


def _text(blocks: str | list[dict[str, Any]], field: str) -> str:
    if isinstance(blocks, str):
        return blocks
    texts = []
    for block in blocks:
        if block.get("type") in _DROPPED_BLOCKS:
            continue
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise ValidationError(f"{field}: content blocks of type {block.get('type')!r} are not supported "
                                  "here; only text", field)
        texts.append(block["text"])
    return "\n".join(texts)


def _chat_messages(request: MessagesTokenCountRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if request.system:
        out.append({"role": "system", "content": _text(request.system, "system")})
    for i, message in enumerate(request.messages):
        field = f"messages.{i}.content"
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        texts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        for block in message.content:
            kind = block.get("type")
            if kind == "tool_result" and message.role == "user":
                out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                            "content": _text(block.get("content") or "", field)})
            elif kind == "tool_use" and message.role == "assistant":
                calls.append({"id": str(block.get("id", "")), "type": "function",
                              "function": {"name": block.get("name"),
                                           "arguments": json.dumps(block.get("input") or {})}})
            else:
                texts.append(block)
        text = _text(texts, field)
        if calls:
            out.append({"role": "assistant", "content": text or None, "tool_calls": calls})
        elif text or not any(b.get("type") == "tool_result" for b in message.content):
            out.append({"role": message.role, "content": text})
    return out


def _chat_tool(tool: dict[str, Any], index: int) -> dict[str, Any]:
    if tool.get("type") not in (None, "custom"):
        raise ValidationError(f"tools.{index}: Anthropic's server tools ({tool.get('type')!r}) are not "
                              "available here; give custom tools (name, description, input_schema)", "tools")
    function = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: dict[str, Any] | None) -> dict[str, Any]:
    if choice is None:
        return {}
    kind = choice.get("type")
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        mapped = {"type": "function", "function": {"name": choice.get("name")}}
    if mapped is None:
        raise ValidationError(f"tool_choice.type must be auto, any, tool or none; got {kind!r}", "tool_choice")
    out: dict[str, Any] = {"tool_choice": mapped}
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out


def stop_reason(finish_reason: str | None, matched: int | str | None,
                stop_sequences: list[str] | None) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a finished choice: a matched stop string is
    stop_sequence, an end-of-sequence token end_turn."""
    if finish_reason == "stop" and isinstance(matched, str) and matched in (stop_sequences or ()):
        return "stop_sequence", matched
    if finish_reason is None:
        return None, None
    return _STOP_REASONS.get(finish_reason, "end_turn"), None


def tool_use_block(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": json.loads(arguments or "{}")}


def to_message(response: ChatCompletionResponse, stop_sequences: list[str] | None) -> MessageResponse:
    choice = response.choices[0]
    content: list[dict[str, Any]] = []
    if choice.message.content:
        content.append({"type": "text", "text": choice.message.content})
    for call in choice.message.tool_calls:
        content.append(tool_use_block(call.id, call.function.name, call.function.arguments))
    reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason, stop_sequences)
    usage = response.usage
    return MessageResponse(model=response.model, content=content, stop_reason=reason, stop_sequence=sequence,
                           usage=to_usage(usage.model_dump() if usage else {}))


def to_usage(usage: dict[str, Any]) -> AnthropicUsage:
    """Anthropic counts the prompt's tokens read from the cache apart from input_tokens."""
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return AnthropicUsage(input_tokens=usage.get("prompt_tokens", 0) - cached,
                          output_tokens=usage.get("completion_tokens", 0), cache_read_input_tokens=cached)
