"""OpenAI's Responses API bodies, and their translation to and from a chat completion.

The route translates, the chat handler computes (DESIGN.md §3b): ``input`` items become chat
messages (``instructions`` the system message, ``function_call`` items an assistant message's
``tool_calls``, ``function_call_output`` items ``tool`` messages), flat function tools become the
chat API's nested ones, and ``text.format`` becomes ``response_format``. Reasoning items are
accepted and kept in the stored conversation but not rendered: the models served here have no
reasoning channel to feed them to.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import Field

from pagedllm.entrypoints.openai.protocol import OpenAIBaseModel
from pagedllm.entrypoints.openai.protocol_chat import ChatCompletionRequest, ChatCompletionResponse
from pagedllm.entrypoints.openai.request_base import OpenAIRequest
from pagedllm.errors import ValidationError

# Chat request fields -> the Responses field a client wrote (error messages name the latter).
CHAT_TO_RESPONSES_PARAM = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                           "max_tokens": "max_output_tokens", "response_format": "text"}
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = {"input_text", "output_text", "text", "summary_text"}


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesRequest(OpenAIRequest):
    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    stream: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    background: bool | None = None
    include: list[str] | None = None
    truncation: str | None = None
    user: str | None = None
    # vLLM's sampling extras, as on the chat route
    top_k: int | None = None
    seed: int | None = None

    def check(self) -> None:
        if self.background:
            raise ValidationError("background responses are not supported; leave background out", "background")
        if self.input is None and self.previous_response_id is None:
            raise ValidationError("give input (a string or a list of items)", "input")
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise ValidationError("input must not be empty", "input")

    def input_items(self) -> list[dict[str, Any]]:
        if self.input is None:
            return []
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return list(self.input)

    def chat_request(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat completion this request means, after the stored conversation ``history``."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += items_to_messages(history + self.input_items())
        if not messages:
            raise ValidationError("input holds no message to answer", "input")
        return ChatCompletionRequest(
            messages=messages, model=self.model, max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
            tools=chat_tools(self.tools), tool_choice=chat_tool_choice(self.tool_choice),
            parallel_tool_calls=self.parallel_tool_calls, response_format=response_format(self.text),
            user=self.user, stream=self.stream,
            stream_options={"include_usage": True} if self.stream else None)


# -- input -> chat messages ----------------------------------------------------------------------
def items_to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages; consecutive function calls share one assistant message."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if not isinstance(item, dict):
            raise ValidationError("each input item must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item["role"]) if isinstance(item.get("role"), str) else None
            if role is None:
                raise ValidationError(f"input message role {item.get('role')!r} is not one of "
                                      f"{', '.join(_ROLES)}", "input")
            messages.append({"role": role, "content": _text(item.get("content"))})
        elif kind == "function_call":
            call = {"id": _str_field(item, "call_id"), "type": "function",
                    "function": {"name": _str_field(item, "name"), "arguments": item.get("arguments") or "{}"}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _str_field(item, "call_id"),
                             "content": output if isinstance(output, str) else _text(output)})
        elif kind != "reasoning":
            raise ValidationError(f"input items of type {kind!r} are not supported; use message, "
                                  "function_call, function_call_output or reasoning", "input")
    return messages


def _str_field(item: dict[str, Any], name: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise ValidationError(f"a {item.get('type')} input item needs a string {name!r}", "input")
    return value


def _text(content: Any) -> str:
    """A message's content: a string, or text parts joined (other parts are refused)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValidationError("a message's content must be a string or a list of text parts", "input")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValidationError(f"content parts of type {kind!r} are not supported; only input_text "
                                  "and output_text", "input")
        texts.append(part["text"])
    return "\n".join(texts)


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Flat function tools ({"type", "name", "parameters", ...}) as the chat API nests them."""
    if tools is None:
        return None
    out = []
    for tool in tools:
        if tool.get("type") != "function":
            raise ValidationError(f"tools of type {tool.get('type')!r} are not supported; only function tools",
                                  "tools")
        function = {k: v for k, v in tool.items() if k != "type" and v is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise ValidationError('tool_choice must be none, auto, required or {"type": "function", "name": ...}',
                              "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's response_format (json_schema's fields sit flat in Responses)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise ValidationError("text.format.type must be text, json_object or json_schema", "text")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    spec = {k: fmt.get(k) for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


# -- response bodies ------------------------------------------------------------------------------
class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(OpenAIBaseModel):
    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: item_id("msg"))
    status: str = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(OpenAIBaseModel):
    type: Literal["function_call"] = "function_call"
    id: str = Field(default_factory=lambda: item_id("fc"))
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


def make_response_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> ResponseUsage:
    return ResponseUsage(input_tokens=prompt_tokens, output_tokens=completion_tokens,
                         input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
                         total_tokens=prompt_tokens + completion_tokens)


class ResponseObject(OpenAIBaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "completed"
    model: str
    output: list[OutputMessage | FunctionCallItem] = Field(default_factory=list)
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, str] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: str = "disabled"
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    usage: ResponseUsage | None = None


def new_response(request: ResponsesRequest, response_id: str, model: str) -> ResponseObject:
    """The response's echo of its request, before any output."""
    return ResponseObject(
        id=response_id, model=model, status="in_progress", instructions=request.instructions,
        max_output_tokens=request.max_output_tokens, temperature=request.temperature, top_p=request.top_p,
        tools=list(request.tools or []), tool_choice=request.tool_choice or ("auto" if request.tools else "none"),
        parallel_tool_calls=request.parallel_tool_calls is not False,
        previous_response_id=request.previous_response_id, reasoning=request.reasoning, store=request.store,
        text=request.text or {"format": {"type": "text"}}, truncation=request.truncation or "disabled",
        metadata=dict(request.metadata or {}), user=request.user)


def mark_finished(response: ResponseObject, finish_reason: str | None) -> None:
    """Completed, or incomplete when max_output_tokens cut the answer."""
    if finish_reason == "length":
        response.status, response.incomplete_details = "incomplete", {"reason": "max_output_tokens"}
    else:
        response.status = "completed"


def from_chat(response: ResponseObject, chat: ChatCompletionResponse) -> ResponseObject:
    """A whole chat completion's first choice as the response's output items."""
    choice = chat.choices[0]
    message = choice.message
    if message.content or not message.tool_calls:
        response.output.append(OutputMessage(content=[OutputText(text=message.content or "")]))
    for call in message.tool_calls:
        response.output.append(FunctionCallItem(call_id=call.id, name=call.function.name,
                                                arguments=call.function.arguments))
    mark_finished(response, choice.finish_reason)
    if chat.usage is not None:
        details = chat.usage.prompt_tokens_details
        response.usage = make_response_usage(chat.usage.prompt_tokens, chat.usage.completion_tokens,
                                             details.cached_tokens if details else 0)
    return response
