"""POST /v1/completions: one engine request per prompt, n choices each (choice index =
prompt index * n + sample index), streamed as SSE deltas or returned whole."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedllm.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    make_usage,
    random_id,
)
from pagedllm.entrypoints.openai.request_extras import check_truncate, prompt_logprobs_json, truncate
from pagedllm.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIServing,
    Stream,
    collect_final,
    decoded,
    merge_streams,
    sse,
    sse_error,
    with_cancellation,
)
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput

_MIN_LOGPROB = -9999.0  # JSON has no -inf


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Any:
        self.check_model(request.model)
        request.check_extra_fields()
        params = request.to_sampling_params(self.generation_defaults)
        prompts = request.prompts()
        self.check_limits(request.n * len(prompts), "n",
                          {"logprobs": request.logprobs, "prompt_logprobs": request.prompt_logprobs}, params)
        check_truncate(request.truncate_prompt_tokens, self.llm.max_model_len)
        params = await self.apply_token_bans(request, params)
        prompts = await self._engine_prompts(request, prompts)
        request_id = request.request_id or random_id("cmpl")
        streams = await self.add_requests(request_id, prompts, params, request.priority,
                                          self.cache_salt(raw_request, request.cache_salt), request.model)
        created = int(time.time())
        if request.stream:
            return StreamingResponse(self._stream(request, request_id, created, streams),
                                     media_type="text/event-stream")
        finals = await with_cancellation(raw_request, collect_final(streams))
        return self._response(request, request_id, created, finals)

    async def _engine_prompts(self, request: CompletionRequest, prompts: list[Any]) -> list[Any]:
        """The prompts as the engine gets them: tokenized here when the request truncates them
        or turns special tokens off (the engine's own tokenization adds them)."""
        if request.truncate_prompt_tokens is None and request.add_special_tokens:
            return prompts
        out: list[Any] = []
        for p in prompts:
            text = p if isinstance(p, str) else None
            ids = await self.tokenize_prompt(p, request.add_special_tokens) if text is not None else list(p)
            kept = truncate(ids, request.truncate_prompt_tokens, self.llm.max_model_len)
            # A truncated prompt's text is no longer the request's: echo decodes the ids instead.
            out.append({"prompt_token_ids": kept,
                        **({"prompt": text} if text is not None and len(kept) == len(ids) else {})})
        return out

    # -- whole response ------------------------------------------------------------------------
    def _response(self, request: CompletionRequest, request_id: str, created: int,
                  finals: list[RequestOutput]) -> CompletionResponse:
        choices: list[CompletionChoice] = []
        num_prompt = num_generated = num_cached = 0
        for i, out in enumerate(finals):
            num_prompt += len(out.prompt_token_ids)
            num_cached += out.num_cached_tokens
            for c in out.outputs:
                num_generated += len(c.token_ids)
                choices.append(self._choice(request, i, out, c, first=True, offset=0))
        return CompletionResponse(id=request_id, created=created, model=self.response_model(request.model),
                                  choices=choices, usage=make_usage(num_prompt, num_generated, num_cached))

    def _choice(self, request: CompletionRequest, prompt_index: int, out: RequestOutput,
                c: CompletionOutput, first: bool, offset: int) -> CompletionChoice:
        """One choice (or one stream delta of it). The first delta of a choice (or the whole
        choice) carries what belongs to the prompt: the echo, prompt logprobs and token ids."""
        echo = request.echo and first
        text = c.text
        logprobs = None
        if request.logprobs is not None:
            logprobs = CompletionLogProbs()
            if echo:
                offset = self._add_logprobs(logprobs, out.prompt_token_ids, out.prompt_logprobs, offset)
            self._add_logprobs(logprobs, c.token_ids, c.logprobs, offset)
        if echo:
            text = self._prompt_text(out) + text
        return CompletionChoice(
            index=prompt_index * request.n + c.index, text=text, logprobs=logprobs,
            finish_reason=c.finish_reason, stop_reason=c.stop_reason,
            prompt_logprobs=(prompt_logprobs_json(self.llm.tokenizer, out.prompt_logprobs)
                             if first and request.prompt_logprobs is not None else None),
            prompt_token_ids=list(out.prompt_token_ids) if first and request.return_token_ids else None,
            token_ids=list(c.token_ids) if request.return_token_ids else None)

    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.llm.tokenizer.decode(out.prompt_token_ids) if self.llm.tokenizer is not None else ""

    def _add_logprobs(self, lp: CompletionLogProbs, token_ids: list[int],
                      positions: list[dict[int, Logprob] | None] | None, offset: int) -> int:
        """Append one entry per token; returns the text offset after them."""
        tokenizer = self.llm.tokenizer
        positions = positions if positions is not None else [None] * len(token_ids)
        for tok, entries in zip(token_ids, positions):
            chosen = entries.get(tok) if entries else None
            token = decoded(tokenizer, tok, chosen)
            lp.tokens.append(token)
            lp.text_offset.append(offset)
            offset += len(token)
            if entries is None:  # the first prompt token has no logprob
                lp.token_logprobs.append(None)
                lp.top_logprobs.append(None)
                continue
            lp.token_logprobs.append(max(chosen.logprob, _MIN_LOGPROB) if chosen is not None else None)
            lp.top_logprobs.append({decoded(tokenizer, t, e): max(e.logprob, _MIN_LOGPROB)
                                    for t, e in entries.items()})
        return offset

    # -- stream --------------------------------------------------------------------------------
    async def _stream(self, request: CompletionRequest, request_id: str, created: int,
                      streams: list[Stream]) -> AsyncIterator[str]:
        started: set[int] = set()  # choices whose first chunk went out (it carries the echo)
        offsets: dict[int, int] = {}  # logprobs text_offset per choice
        num_prompt = num_generated = num_cached = 0
        try:
            async for i, out in merge_streams(streams):
                for c in out.outputs:
                    index = i * request.n + c.index
                    first = index not in started
                    if not (c.text or c.token_ids or c.finish_reason or (first and request.echo)):
                        continue  # nothing new (text held back while a stop string may match)
                    started.add(index)
                    choice = self._choice(request, i, out, c, first, offsets.get(index, 0))
                    if choice.logprobs is not None:
                        offsets[index] = offsets.get(index, 0) + sum(map(len, choice.logprobs.tokens))
                    num_generated += len(c.token_ids)
                    yield sse(CompletionResponse(id=request_id, created=created,
                                                 model=self.response_model(request.model), choices=[choice]))
                if out.finished:
                    num_prompt += len(out.prompt_token_ids)
                    num_cached += out.num_cached_tokens
            if request.stream_options is not None and request.stream_options.include_usage:
                yield sse(CompletionResponse(id=request_id, created=created, model=self.response_model(request.model),
                                             choices=[], usage=make_usage(num_prompt, num_generated, num_cached)))
        except Exception as e:  # noqa: BLE001 - the status line is sent: report in the stream
            yield sse_error(e)
        yield SSE_DONE
