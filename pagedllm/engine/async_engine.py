"""AsyncLLM: the engine for a server, one asyncio stream per request.

One background task drives ``LLMEngine.step()``. Every engine call (add, abort, step, metrics,
tokenizer work) runs on a single worker thread, so the event loop stays responsive while a step
computes and the engine is never touched by two threads at once (the lock makes that explicit for
the few synchronous callers). Each request's outputs go to its own ``asyncio.Queue``.

Lifecycle of a stream: ``generate()`` validates and queues the request (a ``ValidationError``
reaches the caller, nothing is queued), then yields RequestOutputs until the finished one. If the
consumer goes away (the generator is closed or cancelled), the request is aborted before the next
step, so its KV blocks are free for that step. If the loop itself fails, the engine is marked dead
and every open stream raises :class:`EngineDeadError` instead of hanging.
"""
from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pagedllm.beam_search_params import BeamSearchParams
from pagedllm.checkpoint.hub import resolve_engine_args
from pagedllm.config import EngineConfig
from pagedllm.engine.core_client import multiprocessing_enabled  # noqa: F401 - for the CLI
from pagedllm.engine.input_processor import PromptType
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.errors import EngineDeadError, check_request_id_free
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.pooling_outputs import PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")
DEFAULT_WATCHDOG_TIMEOUT_S = 120.0
_MAX_SERVED_BY = 8192  # data parallel: the replica of this many recent requests, for /metrics


@dataclass
class RequestStats:
    """Latencies of one finished request, for the server's histograms (seconds)."""
    e2e: float
    queue: float | None
    ttft: float | None
    inter_token: list[float] = field(default_factory=list)
    engine: str = "0"  # the data-parallel replica that served it (the metrics' engine label)


StatLogger = Callable[[RequestStats], None]


class AsyncLLM:
    def __init__(self, engine: LLMEngine, watchdog_timeout_s: float = DEFAULT_WATCHDOG_TIMEOUT_S) -> None:
        self.engine = engine
        # The watchdog: requests are open but no step has computed a token for this long (the
        # loop idle with work left, or a step that never returns): the engine is stuck. 0: off.
        self.watchdog_timeout_s = watchdog_timeout_s
        self._last_progress = time.monotonic()
        self._stuck_reported = False
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-engine")
        # Request-side tokenizer work (prompts, chat templates, /tokenize) runs on a thread of its
        # own with a tokenizer of its own (HF tokenizers must not be used by two threads at
        # once): a huge prompt never stalls the engine loop and the streams it feeds.
        self._input_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-input")
        self._input_tokenizer = copy.deepcopy(engine.tokenizer) if engine.tokenizer is not None else None
        self._streams: dict[str, asyncio.Queue] = {}
        self._pending_aborts: list[str] = []
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._dead: EngineDeadError | None = None
        self.stat_loggers: list[StatLogger] = []
        self.num_aborted_requests = 0
        self.num_aborted_by_engine: dict[str, int] = {}
        # Data parallel: request id -> the replica it was routed to, kept past its finish (the
        # server records a request's metrics after its last output), bounded.
        self._served_by: OrderedDict[str, str] = OrderedDict()
        self._owns_engine = False  # built by from_engine_args: shutdown() stops the engine too
        # A core process that dies while nothing waits on it: fail every stream now, /health 503.
        getattr(engine.engine_core, "on_dead", []).append(self._engine_core_died)

    @classmethod
    def from_engine_args(cls, model: str | None = None,
                         watchdog_timeout_s: float = DEFAULT_WATCHDOG_TIMEOUT_S,
                         multiprocess: bool | None = None, **engine_args: Any) -> "AsyncLLM":
        """``multiprocess``: the engine core in its own process (None: the
        PAGEDLLM_ENABLE_MULTIPROCESSING environment variable; ``pagedllm serve`` defaults it on)."""
        model, engine_args = resolve_engine_args(model, engine_args)  # a Hub id: the cached folder
        engine = LLMEngine(EngineConfig.from_kwargs(model, **engine_args), multiprocess=multiprocess)
        llm = cls(engine, watchdog_timeout_s)
        llm._owns_engine = True
        return llm

    def _engine_core_died(self, error: EngineDeadError) -> None:
        """Called on the core client's monitor thread: hand the failure to the event loop."""
        task = self._loop_task
        if task is None or task.done():
            self._dead = self._dead or error
            return
        task.get_loop().call_soon_threadsafe(self._fail_all, error)

    # -- what the server reads -----------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        """The request side's tokenizer: use it through ``run_input``."""
        return self._input_tokenizer

    async def run_input(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run request-side tokenizer work on the input thread, off the engine loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._input_executor, lambda: fn(*args, **kwargs))

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_info(self) -> Any:
        return self.engine.model_info

    @property
    def model_path(self) -> str:
        return self.engine.config.model_config.model

    @property
    def errored(self) -> bool:
        return self._dead is not None

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead

    def default_sampling_params(self) -> SamplingParams:
        return self.engine.default_sampling_params()

    def stuck_reason(self) -> str | None:
        """Why the engine is stuck, or None. Read on the event loop, never waiting for the
        engine thread (which may be the thing that hangs)."""
        if not self.watchdog_timeout_s or not self._streams:
            return None
        idle = time.monotonic() - self._last_progress
        if idle <= self.watchdog_timeout_s:
            return None
        reason = (f"the engine is stuck: {len(self._streams)} requests open, no token computed "
                  f"for {idle:.1f} s (watchdog timeout {self.watchdog_timeout_s:g} s)")
        if not self._stuck_reported:
            self._stuck_reported = True
            logger.error(reason)
        return reason

    def health_error(self) -> str | None:
        """What /health reports: the engine is dead or stuck (None: healthy)."""
        if self._dead is not None:
            return f"the engine is dead: {self._dead}"
        return self.stuck_reason()

    # -- engine thread -------------------------------------------------------------------------
    def _locked(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        with self._lock:
            return fn(*args, **kwargs)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the engine thread, between steps (tokenizer work, engine calls)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: self._locked(fn, *args, **kwargs))

    async def get_metrics(self) -> dict[str, float]:
        stuck = self.stuck_reason() is not None  # before waiting for the engine thread
        metrics = await self.run(self.engine.get_metrics)
        metrics["pagedllm:request_aborted"] = self.num_aborted_requests
        metrics["pagedllm:engine_stuck"] = float(stuck)
        return metrics

    @property
    def data_parallel_size(self) -> int:
        return self.engine.config.parallel_config.data_parallel_size

    def engine_label(self, request_id: str) -> str:
        """The ``engine`` label of the replica that served ``request_id`` ("0" without data
        parallelism, or once the request is too old to be remembered)."""
        return self._served_by.get(request_id, "0")

    async def get_metrics_by_engine(self) -> dict[str, dict[str, float]]:
        """``get_metrics()`` per data-parallel replica, keyed by its ``engine`` label."""
        per_engine = getattr(self.engine.engine_core, "get_metrics_per_engine", None)
        if per_engine is None:
            return {"0": await self.get_metrics()}
        stuck = self.stuck_reason() is not None
        snapshots = await self.run(per_engine)
        out = {}
        for i, metrics in enumerate(snapshots):
            metrics["pagedllm:request_aborted"] = self.num_aborted_by_engine.get(str(i), 0)
            metrics["pagedllm:engine_stuck"] = float(stuck)
            out[str(i)] = metrics
        return out

    def _add_on_engine(self, add: Callable[..., None], request_id: str, *args: Any) -> None:
        """Queue a request (on the engine thread) and note which replica took it."""
        add(request_id, *args)
        locate = getattr(self.engine.engine_core, "engine_index_of", None)
        if locate is not None:
            self._served_by[request_id] = str(locate(request_id))
            if len(self._served_by) > _MAX_SERVED_BY:
                self._served_by.popitem(last=False)

    async def reset_prefix_cache(self) -> bool:
        return await self.run(self.engine.reset_prefix_cache)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        return await self.run(self.engine.add_lora, lora_request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        return await self.run(self.engine.remove_lora, lora_int_id)

    async def abort(self, request_id: str) -> None:
        """Abort a request from outside its stream; the stream then ends without a finished output."""
        queue = self._streams.pop(request_id, None)
        await self.run(self.engine.abort_request, request_id)
        if queue is not None:
            queue.put_nowait((time.monotonic(), None))

    # -- the loop ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the background loop on the running event loop (done lazily by generate())."""
        loop = asyncio.get_running_loop()
        if self._loop_task is None:
            self._wake = asyncio.Event()
            self._loop_task = loop.create_task(self._run_loop(), name="pagedllm-loop")
        elif self._loop_task.get_loop() is not loop:
            raise RuntimeError("this AsyncLLM runs on another event loop; make one per loop")

    def _step(self, aborts: list[str]) -> tuple[list[RequestOutput], bool]:
        with self._lock:
            if aborts:
                self.engine.abort_request(aborts)
            if not self.engine.has_unfinished_requests():
                self._progress()
                return [], False
            computed = self.engine.num_scheduled_tokens
            outputs = self.engine.step()
            if self.engine.num_scheduled_tokens > computed:
                self._progress()
            return outputs, self.engine.has_unfinished_requests()

    def _progress(self) -> None:
        self._last_progress = time.monotonic()
        if self._stuck_reported:
            self._stuck_reported = False
            logger.warning("the engine makes progress again")

    async def _run_loop(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        try:
            while True:
                await self._wake.wait()
                # Cleared before the step: an add or abort during the step wakes the next one.
                self._wake.clear()
                aborts, self._pending_aborts = self._pending_aborts, []
                outputs, busy = await loop.run_in_executor(self._executor, self._step, aborts)
                now = time.monotonic()
                for out in outputs:
                    # Popped once finished: the stream keeps its queue, and a stream that is
                    # never read (its client left before the first byte) leaves nothing behind.
                    queue = (self._streams.pop(out.request_id, None) if out.finished
                             else self._streams.get(out.request_id))
                    if queue is not None:
                        queue.put_nowait((now, out))
                if busy:
                    self._wake.set()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - any failure kills the engine, loudly
            logger.exception("engine loop failed; the engine is dead")
            self._fail_all(EngineDeadError(f"the engine loop failed: {type(e).__name__}: {e}"), e)

    def _fail_all(self, error: EngineDeadError, cause: BaseException | None = None) -> None:
        if cause is not None:
            error.__cause__ = cause
        if self._dead is None:
            self._dead = error
        for queue in self._streams.values():
            queue.put_nowait((time.monotonic(), self._dead))

    async def shutdown(self) -> None:
        """Stop the loop; open streams end with EngineDeadError. Idempotent."""
        self._fail_all(EngineDeadError("the engine was shut down"))
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):
                pass
        # A core process this AsyncLLM started is stopped and reaped here (its shutdown is safe
        # from any thread, even with a step in progress); an in-process one between two steps.
        if self._owns_engine:
            self._owns_engine = False
            in_process = not hasattr(self.engine.engine_core, "on_dead")
            await asyncio.to_thread(self._shutdown_in_process if in_process else self.engine.shutdown)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._input_executor.shutdown(wait=False, cancel_futures=True)

    def _shutdown_in_process(self) -> None:
        """Stop the in-process engine once a step in flight ends: its executor lets go of the
        weights and KV cache, so they are freed now, not at the collector's next full pass."""
        if not self._lock.acquire(timeout=self.watchdog_timeout_s or -1):
            logger.warning("a step is still running; the engine's memory is left to the garbage collector")
            return
        try:
            self.engine.shutdown()
        finally:
            self._lock.release()

    # -- requests ------------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | BeamSearchParams,
                          priority: int = 0, cache_salt: str | None = None,
                          arrival_time: float | None = None,
                          lora_request: LoRARequest | None = None) -> "RequestStream":
        """Queue a request now (a ValidationError raises here, nothing queued) and return its
        stream. A server validates every prompt this way before it sends a status line."""
        if self._dead is not None:
            raise self._dead
        self.start()
        check_request_id_free(request_id, self._streams)  # before its stream replaces another
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        if not self._streams:  # the watchdog counts from the first open request on
            self._last_progress = time.monotonic()
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        try:
            prompt = await self._tokenized(prompt)
            if isinstance(params, BeamSearchParams):
                await self.run(self._add_on_engine, self.engine.add_beam_search_request, request_id,
                               prompt, params, priority)
            else:
                await self.run(self._add_on_engine, self.engine.add_request, request_id, prompt,
                               params, arrival_time, priority, cache_salt, lora_request)
        except BaseException as e:
            self._streams.pop(request_id, None)
            if isinstance(e, asyncio.CancelledError):
                self._abort_soon(request_id)  # the add may still complete on the engine thread
            raise
        assert self._wake is not None
        self._wake.set()
        kind = params.output_kind if isinstance(params, SamplingParams) else RequestOutputKind.FINAL_ONLY
        return RequestStream(self, request_id, queue, _LatencyTracker(arrival_time, kind))

    async def _tokenized(self, prompt: PromptType) -> PromptType:
        """Text prompts tokenized on the input thread (the engine then only checks the ids)."""
        text = prompt if isinstance(prompt, str) else (
            prompt.get("prompt") if isinstance(prompt, dict) and "prompt_token_ids" not in prompt else None)
        if not isinstance(text, str) or self._input_tokenizer is None:
            return prompt  # token ids already, or something the engine will reject clearly
        ids = await self.run_input(lambda: list(self._input_tokenizer(text).input_ids))
        return {"prompt": text, "prompt_token_ids": ids}

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str, *,
                       priority: int = 0, cache_salt: str | None = None,
                       arrival_time: float | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's outputs (as many as ``params.output_kind`` gives), the last one
        finished. Closing or cancelling the generator aborts the request."""
        stream = await self.add_request(request_id, prompt, params, priority, cache_salt, arrival_time)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def encode(self, prompt: PromptType, params: PoolingParams, request_id: str,
                     priority: int = 0) -> PoolingRequestOutput:
        """A pooling request's one output (its vector); ValidationError before anything is
        queued if it is bad. Cancelling the wait aborts it."""
        if self._dead is not None:
            raise self._dead
        self.start()
        check_request_id_free(request_id, self._streams)
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        try:
            await self.run(self._add_on_engine, self.engine.add_pooling_request, request_id, prompt,
                           params, None, priority)
            assert self._wake is not None
            self._wake.set()
            _, item = await queue.get()
        except BaseException:
            if self._streams.pop(request_id, None) is not None:
                self._abort_soon(request_id)
            raise
        if isinstance(item, BaseException):
            raise item
        if item is None:
            raise EngineDeadError(f"pooling request {request_id} was aborted")
        return item

    def _abort_soon(self, request_id: str) -> None:
        """Abort before the next step (callable from a generator's finally, which cannot wait)."""
        self.num_aborted_requests += 1
        label = self.engine_label(request_id)
        self.num_aborted_by_engine[label] = self.num_aborted_by_engine.get(label, 0) + 1
        self._pending_aborts.append(request_id)
        if self._wake is not None:
            self._wake.set()

    def _log_stats(self, stats: RequestStats) -> None:
        for stat_logger in self.stat_loggers:
            try:
                stat_logger(stats)
            except Exception:  # noqa: BLE001 - metrics never break a request
                logger.exception("stat logger failed")


class RequestStream:
    """One request's outputs as an async iterator. Closing it before the finished output, or
    cancelling a wait on it, aborts the request (before the engine's next step)."""

    def __init__(self, llm: AsyncLLM, request_id: str, queue: asyncio.Queue,
                 tracker: "_LatencyTracker") -> None:
        self.llm = llm
        self.request_id = request_id
        self._queue = queue
        self._tracker = tracker
        self._done = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            now, item = await self._queue.get()
        except BaseException:  # cancelled: the consumer is gone
            self.close()
            raise
        if item is None or isinstance(item, BaseException):  # aborted, or the engine died
            self._done = True
            self.llm._streams.pop(self.request_id, None)
            if item is None:
                raise StopAsyncIteration
            raise item
        self._tracker.update(now, item)
        if item.finished:
            self._done = True
            self.llm._streams.pop(self.request_id, None)
            stats = self._tracker.finish(item)
            stats.engine = self.llm.engine_label(self.request_id)
            self.llm._log_stats(stats)
        return item

    def close(self) -> None:
        """Abort the request unless it finished (idempotent; safe in any finally block)."""
        if not self._done:
            self._done = True
            self.llm._streams.pop(self.request_id, None)
            if self.llm._dead is None:
                self.llm._abort_soon(self.request_id)

    async def aclose(self) -> None:
        self.close()


class _LatencyTracker:
    """Collects one request's token timings as its outputs arrive (exact for streams; a final-only
    request sees its tokens at once, so its inter-token latency is the mean over its tokens)."""

    def __init__(self, arrival_time: float, kind: RequestOutputKind) -> None:
        self.arrival_time = arrival_time
        self.kind = kind
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_tokens: dict[int, int] = {}
        self.inter_token: list[float] = []

    def update(self, now: float, out: RequestOutput) -> None:
        got = False
        for c in out.outputs:
            if c.token_ids:
                got = True
                if self.kind == RequestOutputKind.DELTA:
                    self.num_tokens[c.index] = self.num_tokens.get(c.index, 0) + len(c.token_ids)
                else:
                    self.num_tokens[c.index] = len(c.token_ids)
        if not got or self.kind == RequestOutputKind.FINAL_ONLY:
            return
        if self.first_token_time is None:
            self.first_token_time = now
        else:
            self.inter_token.append(now - self.last_token_time)
        self.last_token_time = now

    def finish(self, out: RequestOutput) -> RequestStats:
        m = out.metrics
        end = m.finished_time if m is not None and m.finished_time else time.monotonic()
        queue = None
        if m is not None and m.first_scheduled_time is not None:
            queue = m.first_scheduled_time - self.arrival_time
        ttft, itl = None, self.inter_token
        if self.kind == RequestOutputKind.FINAL_ONLY and m is not None and m.first_token_time is not None:
            ttft = m.first_token_time - self.arrival_time
            num_tokens = max(self.num_tokens.values(), default=0)
            if num_tokens > 1 and m.last_token_time is not None:
                itl = [(m.last_token_time - m.first_token_time) / (num_tokens - 1)] * (num_tokens - 1)
        elif self.first_token_time is not None:
            ttft = self.first_token_time - self.arrival_time
        return RequestStats(e2e=end - self.arrival_time, queue=queue, ttft=ttft, inter_token=itl)
