"""Request and response bodies of the OpenAI-compatible API (OpenAI's names plus vLLM's extras).

Requests accept unknown fields and log them once (vLLM's behaviour; see request_base.py).
Range checks live in :class:`SamplingParams`, the single source of truth; ``to_sampling_params``
only maps names and fills in the model's defaults.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from pagedllm import BeamSearchParams
from pagedllm.entrypoints.openai.request_base import OpenAIRequest
from pagedllm.entrypoints.openai.structured_request import structured_outputs_params
from pagedllm.errors import ValidationError
from pagedllm.sampling_params import GENERATION_DEFAULT_KEYS, RequestOutputKind, SamplingParams
from pagedllm.structured_outputs_params import StructuredOutputsParams


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBaseModel(BaseModel):
    """Base of the response bodies (requests derive from OpenAIRequest)."""
    model_config = ConfigDict(extra="forbid")


class OmitsUnrequested(OpenAIBaseModel):
    """A response body whose vLLM extras (token ids, prompt logprobs) appear only when the
    request asked for them, instead of as nulls in every answer."""
    _omit_if_none: ClassVar[frozenset[str]] = frozenset({"prompt_token_ids", "token_ids", "prompt_logprobs"})

    @model_serializer(mode="wrap")
    def _without_unrequested(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if not (v is None and k in self._omit_if_none)}


# -- errors -------------------------------------------------------------------------------------
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# -- shared request fields ----------------------------------------------------------------------
class StreamOptions(OpenAIRequest):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingRequest(OpenAIRequest):
    """What completions and chat share: OpenAI's sampling fields and vLLM's extras."""
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: int = 0
    cache_salt: str | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    request_id: str | None = None
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    return_token_ids: bool = False
    # Output constraints (OpenAI's, vLLM's): see structured_request.py.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None

    def output_constraint(self) -> StructuredOutputsParams | None:
        """What the output must match (chat adds forced tool calls)."""
        return structured_outputs_params(self.response_format, self.structured_outputs)

    def _beam_search_params(self, max_tokens: int) -> BeamSearchParams:
        """vLLM's form: n beams, returned whole, best first; errors name the request's fields."""
        if self.stream:
            raise ValidationError("use_beam_search cannot be streamed; set stream=false", "stream")
        if self.output_constraint() is not None:
            raise ValidationError("use_beam_search cannot be constrained by structured outputs "
                                  "(nor by a forced tool call)", "use_beam_search")
        try:
            return BeamSearchParams(beam_width=self.n, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                                    length_penalty=self.length_penalty)
        except ValidationError as e:
            if e.param == "beam_width":
                e.param, e.message = "n", e.message.replace("beam_width", "n")
                e.args = (e.message,)
            raise

    def _sampling_params(self, defaults: dict[str, Any], max_tokens: int | None,
                         logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise ValidationError("stream_options is only allowed with stream=true", "stream_options")
        values: dict[str, Any] = {}
        for name in GENERATION_DEFAULT_KEYS:  # the request's value, else the model's
            value = getattr(self, name)
            if value is None:
                value = defaults.get(name)
            if value is not None:
                values[name] = value
        return SamplingParams(
            n=self.n, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, max_tokens=max_tokens,
            min_tokens=self.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logit_bias=self.logit_bias,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=self.output_constraint(),
            **values)


# -- completions --------------------------------------------------------------------------------
class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    prompt_logprobs: int | None = None
    add_special_tokens: bool = True

    def to_sampling_params(self, defaults: dict[str, Any]) -> SamplingParams | BeamSearchParams:
        if self.use_beam_search:
            if self.logprobs is not None or self.echo:
                raise ValidationError("use_beam_search does not return logprobs or echo", "use_beam_search")
            return self._beam_search_params(16 if self.max_tokens is None else self.max_tokens)
        if self.suffix is not None:
            raise ValidationError("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise ValidationError("best_of must equal n (or be left out)", "best_of")
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_logprobs = self.logprobs if prompt_logprobs is None else prompt_logprobs
        return self._sampling_params(defaults, self.max_tokens, self.logprobs, prompt_logprobs)

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per engine request (a list of strings or of token-id lists)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ValidationError("prompt must not be empty", "prompt")
        return list(p)


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OmitsUnrequested):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids
    token_ids: list[int] | None = None


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# -- models, tokenizer --------------------------------------------------------------------------
class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str | None = None
    parent: str | None = None  # an adapter's base model
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIRequest):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
