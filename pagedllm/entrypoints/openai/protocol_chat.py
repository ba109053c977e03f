"""Chat completion bodies (OpenAI's chat API plus vLLM's extras); shared fields in protocol.py."""
from __future__ import annotations

import json
import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from pagedllm import BeamSearchParams
from pagedllm.entrypoints.openai.protocol import OmitsUnrequested, OpenAIBaseModel, SamplingRequest, UsageInfo
from pagedllm.entrypoints.openai.protocol_tools import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionToolsParam,
    DeltaToolCall,
    ToolCall,
)
from pagedllm.entrypoints.openai.tool_request import tool_structured_outputs
from pagedllm.errors import ValidationError
from pagedllm.sampling_params import SamplingParams


class ChatMessage(BaseModel):
    """One message; fields beyond role/content/name go to the chat template untouched."""
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def to_template_dict(self) -> dict[str, Any]:
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):  # content parts: only text is understood
            texts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValidationError(
                        f"content parts of type {part.get('type')!r} are not supported; "
                        "only {'type': 'text', 'text': ...}", "messages")
                texts.append(part["text"])
            d["content"] = "\n".join(texts)
        if self.role == "assistant" and isinstance(d.get("tool_calls"), list):
            d["tool_calls"] = [_template_tool_call(c) for c in d["tool_calls"]]
        return d


def _template_tool_call(call: Any) -> Any:
    """A history tool call as chat templates read it: OpenAI sends the arguments as JSON text,
    templates (and transformers' docs) expect them as an object, so they are parsed here as
    vLLM does; missing arguments are {}."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise ValidationError("an assistant message's tool_calls must be "
                              '{"type": "function", "function": {"name", "arguments"}} objects', "messages")
    function = dict(call["function"])
    arguments = function.get("arguments")
    if not arguments:
        function["arguments"] = {}
    elif isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except ValueError as e:
            raise ValidationError(f"tool call arguments are not valid JSON: {e}", "messages") from e
    return {**call, "function": function}


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False  # the template writes them (vLLM's default for chat)
    echo: bool = False  # prepend the last message to the reply when it is the assistant's
    continue_final_message: bool = False  # the reply continues the last (assistant) message
    # Tool calling: see tool_request.py. tool_choice defaults to "auto" when tools are given.
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam | None = None
    parallel_tool_calls: bool | None = True
    # True where max_tokens is a bound the context may shrink (Anthropic's), not a demand.
    max_tokens_is_bound: ClassVar[bool] = False

    def output_constraint(self) -> Any:
        """A tool call the request forces (required, a named function) is generated under its
        JSON schema; the request may not constrain the output another way at the same time."""
        forced = tool_structured_outputs(self)
        if forced is None:
            return super().output_constraint()
        if self.response_format not in (None, {"type": "text"}) or self.structured_outputs:
            raise ValidationError("tool_choice required or a named function constrains the output "
                                  "already: drop response_format / structured_outputs", "tool_choice")
        return forced

    def effective_tool_choice(self) -> str:
        """"none", "auto", "required" or "named" (OpenAI's default: auto when tools are given)."""
        if isinstance(self.tool_choice, ChatCompletionNamedToolChoiceParam):
            return "named"
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template reads them (rendered even with tool_choice none, as vLLM)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, defaults: dict[str, Any],
                           default_max_tokens: int = 16) -> SamplingParams | BeamSearchParams:
        """``default_max_tokens``: beam search's length when the request gives none (the
        handler passes what the context leaves after the prompt, as vLLM does)."""
        if self.top_logprobs and not self.logprobs:
            raise ValidationError("top_logprobs needs logprobs=true", "top_logprobs")
        if not self.messages:
            raise ValidationError("messages must not be empty", "messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValidationError("continue_final_message needs add_generation_prompt=false",
                                  "continue_final_message")
        max_tokens = self.requested_max_tokens()
        try:
            if self.use_beam_search:
                if self.logprobs:
                    raise ValidationError("use_beam_search does not return logprobs", "use_beam_search")
                return self._beam_search_params(default_max_tokens if max_tokens is None else max_tokens)
            return self._sampling_params(defaults, max_tokens,
                                         (self.top_logprobs or 0) if self.logprobs else None)
        except ValidationError as e:  # name the field as this request spelled it
            if e.param == "logprobs":
                e.param = "top_logprobs"
            elif e.param == "max_tokens" and self.max_completion_tokens is not None:
                e.param = "max_completion_tokens"
            raise

    def conversation(self) -> list[dict[str, Any]]:
        return [m.to_template_dict() for m in self.messages]

    def echoed(self) -> str:
        """What ``echo`` puts before the reply: the last message, if it is the assistant's."""
        last = self.messages[-1] if self.messages else None
        if not self.echo or last is None or last.role != "assistant":
            return ""
        return str(last.to_template_dict().get("content") or "")

    def template_kwargs(self) -> dict[str, Any]:
        kwargs = dict(self.chat_template_kwargs or {})
        if self.continue_final_message:
            kwargs["continue_final_message"] = True
        return kwargs


class ChatLogProb(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatLogProbs(OpenAIBaseModel):
    content: list[ChatLogProbsContent] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)  # vLLM's shape: [] when none


class ChatCompletionChoice(OmitsUnrequested):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(OmitsUnrequested):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids


class DeltaMessage(OpenAIBaseModel):
    """A stream delta names only what it carries (the role once, then content)."""
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(OmitsUnrequested):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionChunk(OmitsUnrequested):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids, in the first chunk
