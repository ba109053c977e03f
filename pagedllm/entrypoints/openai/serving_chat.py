"""POST /v1/chat/completions: messages -> the chat template -> prompt token ids -> one engine
request with n choices; streamed as role/content deltas or returned whole.

With tools, each choice's text goes through a tool parser (tool_parsers/): the server's
--tool-call-parser for tool_choice auto, the schema's own reader for required and a named
function (whose output the structured-output grammar has already forced into shape)."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.engine.tokenizer import apply_chat_template
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.protocol import make_usage, random_id
from pagedllm.entrypoints.openai.protocol_chat import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogProb,
    ChatLogProbs,
    ChatLogProbsContent,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
)
from pagedllm.entrypoints.openai.request_extras import check_truncate, truncate
from pagedllm.entrypoints.openai.server_options import ServerOptions
from pagedllm.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIServing,
    Stream,
    collect_final,
    decoded,
    merge_streams,
    sse,
    sse_error,
    top_by_rank,
    with_cancellation,
)
from pagedllm.entrypoints.openai.template_kwargs import template_variables_only
from pagedllm.entrypoints.openai.tool_parsers import ToolParser, ToolParserManager
from pagedllm.entrypoints.openai.tool_parsers.forced_tool_calls import NamedToolCallParser, RequiredToolCallsParser
from pagedllm.entrypoints.openai.tool_request import check_tool_usage
from pagedllm.errors import ValidationError
from pagedllm.outputs import Logprob

_MIN_LOGPROB = -9999.0  # JSON has no -inf


class OpenAIServingChat(OpenAIServing):
    def __init__(self, llm: AsyncLLM, served_model_names: list[str], chat_template: str | None,
                 options: ServerOptions | None = None, metrics: ServerMetrics | None = None) -> None:
        super().__init__(llm, served_model_names, options, metrics)
        self.chat_template = chat_template
        self.tool_parser: type[ToolParser] | None = None
        if self.options.enable_auto_tool_choice:
            if not self.options.tool_call_parser:
                raise ValidationError("--enable-auto-tool-choice requires --tool-call-parser",
                                      "tool_call_parser")
            self.tool_parser = ToolParserManager.get_tool_parser(self.options.tool_call_parser)

    async def render_prompt(self, messages: list[dict[str, Any]], chat_template: str | None,
                            add_generation_prompt: bool, template_kwargs: dict[str, Any] | None,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Messages to prompt token ids through the request's, the server's or the model's
        template; ``tools`` reach it as transformers passes them (the ``tools`` variable)."""
        tokenizer = self.llm.tokenizer
        if tokenizer is None:
            raise ValidationError("this server has no tokenizer, so it cannot apply a chat template", "messages")
        if chat_template is not None and not self.options.trust_request_chat_template:
            raise ValidationError("a request's own chat_template is a program the server would run; "
                                  "it is refused unless the server is started with "
                                  "--trust-request-chat-template", "chat_template")
        template = chat_template or self.chat_template
        kwargs = template_variables_only(template_kwargs, template or getattr(tokenizer, "chat_template", None))
        if tools is not None:
            kwargs["tools"] = tools
        try:
            return await self.tokenizer_call(apply_chat_template, tokenizer, messages, template,
                                             add_generation_prompt, **kwargs)
        except ValidationError:
            raise
        except Exception as e:  # a broken template or messages it cannot render
            raise ValidationError(f"the chat template failed: {type(e).__name__}: {e}", "messages") from e

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Any:
        self.check_model(request.model)
        request.check_extra_fields()
        tool_choice = check_tool_usage(request, self.tool_parser is not None)
        if tool_choice == "auto":
            self.tool_parser(self.llm.tokenizer).adjust_request(request)
        params = request.to_sampling_params(self.generation_defaults)  # validate before rendering
        self.check_limits(request.n, "n", {"top_logprobs": request.top_logprobs if request.logprobs else None},
                          params)
        check_truncate(request.truncate_prompt_tokens, self.llm.max_model_len)
        params = await self.apply_token_bans(request, params)
        prompt_ids = await self.render_prompt(request.conversation(), request.chat_template,
                                              request.add_generation_prompt, request.template_kwargs(),
                                              request.tool_dicts())
        if request.add_special_tokens:  # what tokenizing the rendered text with them would add
            build = getattr(self.llm.tokenizer, "build_inputs_with_special_tokens", None)
            prompt_ids = list(build(prompt_ids)) if build is not None else prompt_ids
        prompt_ids = truncate(prompt_ids, request.truncate_prompt_tokens, self.llm.max_model_len)
        room = self.llm.max_model_len - len(prompt_ids)
        if request.max_tokens_is_bound and getattr(params, "max_tokens", None) and 0 < room < params.max_tokens:
            params = params.clone(max_tokens=room)
        if request.use_beam_search and request.requested_max_tokens() is None:
            params = request.to_sampling_params(
                self.generation_defaults, max(1, self.llm.max_model_len - len(prompt_ids)))
        request_id = request.request_id or random_id("chatcmpl")
        try:
            streams = await self.add_requests(request_id, [{"prompt_token_ids": prompt_ids}], params,
                                              request.priority,
                                              self.cache_salt(raw_request, request.cache_salt),
                                              request.model)
        except ValidationError as e:  # the prompt is what the messages rendered to: name them
            if e.param == "prompt":
                e.param = "messages"
            raise
        created = int(time.time())
        if request.stream:
            return StreamingResponse(self._stream(request, request_id, created, streams[0], prompt_ids,
                                                  tool_choice),
                                     media_type="text/event-stream")
        out = (await with_cancellation(raw_request, collect_final(streams)))[0]
        k = request.top_logprobs or 0
        choices = []
        for c in out.outputs:
            message, finish_reason = self._message(request, tool_choice, c.text, c.finish_reason)
            choices.append(ChatCompletionChoice(
                index=c.index, message=message,
                logprobs=self._logprobs(c.token_ids, c.logprobs, k) if request.logprobs else None,
                finish_reason=finish_reason, stop_reason=c.stop_reason,
                token_ids=list(c.token_ids) if request.return_token_ids else None))
        usage = make_usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs),
                           out.num_cached_tokens)
        return ChatCompletionResponse(
            id=request_id, created=created, model=self.response_model(request.model), choices=choices, usage=usage,
            prompt_token_ids=list(out.prompt_token_ids) if request.return_token_ids else None)

    def _new_tool_parser(self, request: ChatCompletionRequest, tool_choice: str) -> ToolParser | None:
        if tool_choice == "auto":
            assert self.tool_parser is not None  # check_tool_usage refused auto without one
            return self.tool_parser(self.llm.tokenizer)
        if tool_choice == "required":
            return RequiredToolCallsParser()
        if tool_choice == "named":
            return NamedToolCallParser(request.tool_choice.function.name)
        return None

    def _message(self, request: ChatCompletionRequest, tool_choice: str, text: str,
                 finish_reason: str | None) -> tuple[ChatResponseMessage, str | None]:
        """A whole choice's message and finish reason: tool calls if the text holds them
        (finish_reason tool_calls once the reply ended by itself), else the text as content."""
        parser = self._new_tool_parser(request, tool_choice)
        if parser is None:
            return ChatResponseMessage(content=request.echoed() + text), finish_reason
        info = parser.extract_tool_calls(text, request)
        if not info.tools_called and finish_reason == "length" and tool_choice == "required":
            # An array of calls cut by max_tokens: the calls it finished are answers still.
            info.tool_calls = parser.extract_complete_tool_calls(text)
            info.tools_called, info.content = bool(info.tool_calls), None
        if not info.tools_called:  # no calls, or cut short by max_tokens: the text as it is
            return ChatResponseMessage(content=text), finish_reason
        calls = info.tool_calls if request.parallel_tool_calls is not False else info.tool_calls[:1]
        return (ChatResponseMessage(content=info.content, tool_calls=calls),
                "tool_calls" if finish_reason == "stop" else finish_reason)

    def _logprobs(self, token_ids: list[int], positions: list[dict[int, Logprob]] | None,
                  k: int) -> ChatLogProbs:
        tokenizer = self.llm.tokenizer
        content: list[ChatLogProbsContent] = []
        for tok, entries in zip(token_ids, positions or []):
            chosen = entries.get(tok)
            token = decoded(tokenizer, tok, chosen)
            top = []
            for t, e in top_by_rank(entries, k):
                s = decoded(tokenizer, t, e)
                top.append(ChatLogProb(token=s, logprob=max(e.logprob, _MIN_LOGPROB), bytes=list(s.encode())))
            content.append(ChatLogProbsContent(
                token=token, logprob=max(chosen.logprob, _MIN_LOGPROB) if chosen else _MIN_LOGPROB,
                bytes=list(token.encode()), top_logprobs=top))
        return ChatLogProbs(content=content)

    def _chunk(self, request_id: str, created: int, choice: ChatStreamChoice, model: str) -> str:
        return sse(ChatCompletionChunk(id=request_id, created=created, model=model, choices=[choice]))

    async def _stream(self, request: ChatCompletionRequest, request_id: str, created: int,
                      stream: Stream, prompt_ids: list[int], tool_choice: str = "none") -> AsyncIterator[str]:
        k = request.top_logprobs or 0
        parsers = [self._new_tool_parser(request, tool_choice) for _ in range(request.n)]
        texts = [""] * request.n
        num_generated = num_prompt = num_cached = 0
        try:
            echoed = request.echoed()
            for i in range(request.n):  # the role first, for every choice (OpenAI's order)
                yield sse(ChatCompletionChunk(
                    id=request_id, created=created, model=self.response_model(request.model),
                    prompt_token_ids=list(prompt_ids) if request.return_token_ids and i == 0 else None,
                    choices=[ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=echoed),
                                              logprobs=None, finish_reason=None)]))
            async for _, out in merge_streams([stream]):
                for c in out.outputs:
                    if not (c.text or c.token_ids or c.finish_reason):
                        continue  # nothing new (text held back while a stop string may match)
                    num_generated += len(c.token_ids)
                    delta, finish_reason = DeltaMessage(content=c.text), c.finish_reason
                    parser = parsers[c.index]
                    if parser is not None:
                        previous, texts[c.index] = texts[c.index], texts[c.index] + c.text
                        delta, finish_reason = self._tool_delta(request, parser, previous, texts[c.index],
                                                                c.text, c.finish_reason)
                        if delta is None:
                            continue
                    logprobs = self._logprobs(c.token_ids, c.logprobs, k) if request.logprobs else None
                    choice = ChatStreamChoice(index=c.index, delta=delta,
                                              logprobs=logprobs, finish_reason=finish_reason,
                                              stop_reason=c.stop_reason,
                                              token_ids=list(c.token_ids) if request.return_token_ids else None)
                    yield self._chunk(request_id, created, choice, self.response_model(request.model))
                if out.finished:
                    num_prompt, num_cached = len(out.prompt_token_ids), out.num_cached_tokens
            if request.stream_options is not None and request.stream_options.include_usage:
                yield sse(ChatCompletionChunk(id=request_id, created=created,
                                              model=self.response_model(request.model), choices=[],
                                              usage=make_usage(num_prompt, num_generated, num_cached)))
        except Exception as e:  # noqa: BLE001 - the status line is sent: report in the stream
            yield sse_error(e)
        yield SSE_DONE

    def _tool_delta(self, request: ChatCompletionRequest, parser: ToolParser, previous: str,
                    current: str, delta_text: str, finish_reason: str | None
                    ) -> tuple[DeltaMessage | None, str | None]:
        """One streamed choice's delta through its tool parser (None: nothing to send yet)."""
        delta = parser.extract_tool_calls_streaming(previous, current, delta_text, request,
                                                    finished=finish_reason is not None)
        if delta is not None and delta.tool_calls and request.parallel_tool_calls is False:
            delta.tool_calls = [d for d in delta.tool_calls if d.index == 0] or None
            if delta.tool_calls is None and not delta.content:
                delta = None
        if delta is None and (finish_reason or request.logprobs or request.return_token_ids):
            delta = DeltaMessage()  # the finish (or the tokens' logprobs) still goes out
        if finish_reason == "stop" and parser.tools_streamed:
            finish_reason = "tool_calls"
        return delta, finish_reason
