"""Tool-calling bodies of the chat API: the request's ``tools`` and ``tool_choice`` (OpenAI's
function tools) and the ``tool_calls`` of a reply, whole or as stream deltas (vLLM's shapes)."""
from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from pagedllm.entrypoints.openai.protocol import OpenAIBaseModel


def make_tool_call_id() -> str:
    """vLLM's random tool-call id; clients only echo it back in the ``tool`` message."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


# -- request ------------------------------------------------------------------------------------
class FunctionDefinition(BaseModel):
    """One function a model may call; ``parameters`` is its arguments' JSON schema. Extra keys
    are kept: they reach the chat template, which may render them."""
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionNamedFunction(BaseModel):
    name: str = Field(min_length=1)


class ChatCompletionNamedToolChoiceParam(BaseModel):
    """``{"type": "function", "function": {"name": ...}}``: this function must be called."""
    type: Literal["function"] = "function"
    function: ChatCompletionNamedFunction


# -- response -----------------------------------------------------------------------------------
class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape: clients json.loads it)


class ToolCall(OpenAIBaseModel):
    id: str = Field(default_factory=make_tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class _WithoutNulls(OpenAIBaseModel):
    """A stream delta names only what it carries: the id, type and name come once, in the
    call's first delta; later ones hold argument text alone."""

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_WithoutNulls):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_WithoutNulls):
    index: int  # the call's place in the choice's tool_calls list
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None
