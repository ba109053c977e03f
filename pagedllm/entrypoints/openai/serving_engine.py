"""What the completion and chat handlers share: the model-name check, engine-request bookkeeping,
stream merging, client-disconnect handling, SSE framing and logprob formatting."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from pagedllm import BeamSearchParams, LoRARequest
from pagedllm.engine.async_engine import AsyncLLM, RequestStream
from pagedllm.entrypoints.openai.api_errors import APIError, exception_to_body
from pagedllm.entrypoints.openai.auth import KEY_SALT_STATE, combine_salt
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.request_extras import bad_word_token_ids, ban_bias
from pagedllm.entrypoints.openai.server_options import ServerOptions
from pagedllm.errors import ValidationError
from pagedllm.outputs import Logprob, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

T = TypeVar("T")
logger = logging.getLogger("pagedllm.entrypoints.openai")
SSE_DONE = "data: [DONE]\n\n"


def sse(chunk: BaseModel) -> str:
    """One server-sent event."""
    return f"data: {chunk.model_dump_json()}\n\n"


def sse_error(e: BaseException) -> str:
    return f"data: {exception_to_body(e).model_dump_json()}\n\n"


def engine_max_num_seqs(llm: AsyncLLM) -> int:
    """The engine's batch size (max_num_seqs), for the per-request sequence cap."""
    config = getattr(llm.engine, "config", None)
    return getattr(getattr(config, "scheduler_config", None), "max_num_seqs", 256)


class OpenAIServing:
    def __init__(self, llm: AsyncLLM, served_model_names: list[str],
                 options: ServerOptions | None = None, metrics: ServerMetrics | None = None) -> None:
        self.llm = llm
        self.metrics = metrics
        self.served_model_names = served_model_names
        self.model_name = served_model_names[0]
        self.options = options or ServerOptions()
        self.generation_defaults = self.options.generation_defaults(llm.model_info.generation_defaults)
        self.max_seqs_per_request = self.options.seqs_per_request_cap(engine_max_num_seqs(llm))
        # The adapters served, by name (the request's model picks one); shared by the handlers.
        self.lora_modules: dict[str, LoRARequest] = {}

    def check_limits(self, num_seqs: int, seqs_param: str, logprobs: dict[str, int | None],
                     params: SamplingParams | BeamSearchParams | None = None) -> None:
        """The server's caps (--max-seqs-per-request, --max-logprobs, --max-num-stop-strings),
        as 400s naming the field."""
        stop = getattr(params, "stop", None) or ()
        if len(stop) > self.options.max_num_stop_strings:
            raise ValidationError(f"{len(stop)} stop strings given; the server allows at most "
                                  f"{self.options.max_num_stop_strings} (--max-num-stop-strings)", "stop")
        if num_seqs > self.max_seqs_per_request:
            raise ValidationError(
                f"this request asks for {num_seqs} sequences; the server allows at most "
                f"{self.max_seqs_per_request} per request (--max-seqs-per-request)", seqs_param)
        for name, value in logprobs.items():
            if value is not None and value > self.options.max_logprobs:
                raise ValidationError(f"{name} must be at most {self.options.max_logprobs} "
                                      f"(--max-logprobs), got {value}", name)

    async def apply_token_bans(self, request: Any, params: SamplingParams | BeamSearchParams
                               ) -> SamplingParams | BeamSearchParams:
        """allowed_token_ids and bad_words, as logit_bias entries (see request_extras.py)."""
        if not request.allowed_token_ids and not request.bad_words:
            return params
        field = "allowed_token_ids" if request.allowed_token_ids else "bad_words"
        if isinstance(params, BeamSearchParams):
            raise ValidationError(f"{field} does not work with use_beam_search", field)
        bad = (await self.tokenizer_call(bad_word_token_ids, self.llm.tokenizer, request.bad_words)
               if request.bad_words else [])
        bias = ban_bias(request.allowed_token_ids, bad, self.llm.model_info.vocab_size, params.logit_bias)
        return params.clone(logit_bias=bias)

    async def tokenize_prompt(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.llm.tokenizer is None:
            raise ValidationError("this server has no tokenizer; send token ids", "prompt")
        return list((await self.tokenizer_call(self.llm.tokenizer, text,
                                               add_special_tokens=add_special_tokens)).input_ids)

    def cache_salt(self, raw_request: Request, request_salt: str | None) -> str | None:
        """The request's cache_salt, under its API key's salt with --cache-salt-per-key."""
        return combine_salt(getattr(raw_request.state, KEY_SALT_STATE, None), request_salt)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names and model not in self.lora_modules:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                                f"{', '.join(repr(n) for n in self.served_model_names)}", "model")

    def response_model(self, model: str | None) -> str:
        """The ``model`` a response names: the adapter a request asked for, else the base (as vLLM)."""
        return model if model is not None and model in self.lora_modules else self.model_name

    async def add_requests(self, request_id: str, prompts: list[Any], params: SamplingParams,
                           priority: int, cache_salt: str | None, model: str | None = None) -> list[Stream]:
        """Queue one engine request per prompt; if one is rejected, withdraw those queued."""
        if self.options.enable_log_requests:
            cut = self.options.max_log_len
            shown = [str(p)[:cut] if cut is not None else str(p) for p in prompts]
            logger.info("Received request %s: prompts=%r, params=%r", request_id, shown, params)
        streams: list[Stream] = []
        try:
            for i, prompt in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                stream = await self.llm.add_request(rid, prompt, params, priority, cache_salt,
                                                    lora_request=self.lora_modules.get(model or ""))
                streams.append(stream if self.metrics is None else ObservedStream(stream, params, self.metrics))
        except BaseException:
            for s in streams:
                s.close()
            raise
        return streams

    async def tokenizer_call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Tokenizer work runs on AsyncLLM's input thread with the request side's tokenizer
        (``llm.tokenizer``), off the engine loop: HF tokenizers are not safe to share between
        threads that use them at once, and a huge prompt must not stall the streams."""
        return await self.llm.run_input(fn, *args, **kwargs)


class ObservedStream:
    """A request stream that reports the finished request to the server's metrics (token
    counts per choice are summed from the deltas of a streamed request)."""

    def __init__(self, stream: RequestStream, params: SamplingParams | BeamSearchParams,
                 metrics: ServerMetrics) -> None:
        self._stream = stream
        self._metrics = metrics
        self._delta = isinstance(params, SamplingParams) and params.output_kind == RequestOutputKind.DELTA
        self._n = params.n if isinstance(params, SamplingParams) else params.beam_width
        self._max_tokens = params.max_tokens
        self._num_generated: dict[int, int] = {}

    def __aiter__(self) -> "ObservedStream":
        return self

    async def __anext__(self) -> RequestOutput:
        out = await self._stream.__anext__()
        for c in out.outputs:
            seen = self._num_generated.get(c.index, 0) if self._delta else 0
            self._num_generated[c.index] = seen + len(c.token_ids)
        if out.finished:
            try:
                self._metrics.observe(out, list(self._num_generated.values()), self._n, self._max_tokens)
            except Exception:  # noqa: BLE001 - metrics never break a request
                logger.exception("metrics observation failed")
        return out

    def close(self) -> None:
        self._stream.close()


Stream = RequestStream | ObservedStream


async def merge_streams(streams: list[Stream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (stream index, output); closing the merge (or an
    error in one stream) closes every stream, which aborts the unfinished ones."""
    if len(streams) == 1:  # the common case, without tasks
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].close()
        return
    pending: dict[asyncio.Task, int] = {
        asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(streams[i].__anext__())] = i
                yield i, out
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for s in streams:
            s.close()


async def collect_final(streams: list[Stream]) -> list[RequestOutput]:
    """The finished output of each stream (FINAL_ONLY requests yield just that one)."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in merge_streams(streams):
        if out.finished:
            finals[i] = out
    assert all(f is not None for f in finals)
    return finals  # type: ignore[return-value]


async def with_cancellation(raw_request: Request, work: Awaitable[T]) -> T:
    """Run a non-streaming handler's work, cancelling it if the client disconnects (the
    cancellation closes its streams, which aborts their requests). Streams need no help: the
    ASGI server cancels a streaming body when its client goes away."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise APIError(499, "the client closed the request")
    return task.result()


async def _wait_for_disconnect(raw_request: Request) -> None:
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


def decoded(tokenizer: Any, token_id: int, lp: Logprob | None = None) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def top_by_rank(entries: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely entries of one position's logprob dict."""
    ranked = sorted(entries.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0, -kv[1].logprob))
    return ranked[:k]
