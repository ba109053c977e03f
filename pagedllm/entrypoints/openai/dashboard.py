"""The live dashboard: ``GET /dashboard`` (static HTML + JS, no build step) fed by
``GET /v1/trace/stream``, a server-sent-events stream of step-trace records
(docs/trace_schema.md).

The engine runs on AsyncLLM's worker thread; ``TraceFeed`` is one of its step observers. It costs
almost nothing when nobody watches (a few integer additions and the trace's small request table,
which must see every step's diffs), and when someone does it is sampled: at most
``max_records_per_s`` records a second and a block map at most once a second, so a busy server
is not slowed by its viewers. Records cross to the event loop with ``call_soon_threadsafe`` into
a bounded queue per viewer; a viewer that falls behind loses records, never the engine time.
Every record carries ``totals``, counts since the server started, so the dashboard's numbers
stay exact (and match /metrics) even though most steps are not sent.

When the engine core runs in its own process (``pagedllm serve``'s default) there is no
scheduler here to observe: the feed then tails the core's ``--trace-file`` instead
(trace_file_feed.py), and without one the stream answers 503 saying so.

``/v1/trace/stream`` sits under /v1, so with ``--api-key`` the app's key middleware (auth.py)
guards it like every other /v1 route; the page sends the key it is given (``?key=`` or the
key field) as a Bearer header.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, HTTPException
from fastapi.responses import FileResponse, StreamingResponse

from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.engine.step_trace import SCHEMA_VERSION, StepRecorder, block_map
from pagedllm.entrypoints.openai.trace_file_feed import TraceFileFeed, new_totals
from pagedllm.entrypoints.openai.trace_viewers import TraceViewers, sse_event

STATIC_DIR = Path(__file__).parent / "static"
_STATIC_FILES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}


class TraceFeed:
    """The in-process step observer behind /v1/trace/stream (see the module docstring)."""

    def __init__(self, llm: AsyncLLM, max_records_per_s: float = 20.0,
                 block_map_interval_s: float = 1.0) -> None:
        self.llm = llm
        engine = llm.engine
        scheduler = engine.scheduler  # AttributeError when the core runs in another process
        kv = self.kv = scheduler.kv_cache_manager
        self.header = {"v": SCHEMA_VERSION, "header": True,
                       "max_num_batched_tokens": scheduler.max_num_batched_tokens,
                       "num_blocks": kv.num_blocks, "block_size": kv.block_size}
        self.recorder = StepRecorder(scheduler.max_num_batched_tokens, kv, block_map_interval_s)
        self.min_interval_s = 1.0 / max_records_per_s
        self.totals = new_totals()
        self.viewers = TraceViewers()
        self._last_sent = float("-inf")
        self._flush_pending = False
        engine.step_observers.append(self)

    # -- the engine thread -------------------------------------------------------------------
    def __call__(self, so: Any, outs: Any, timings: Any) -> None:
        s = outs.scheduler_stats
        t = self.totals
        t["steps"] += 1
        t["finished"] += len(outs.finished)
        t["preempted"] += s.num_preempted_reqs
        t["prompt_tokens"] += s.num_prompt_tokens
        t["generation_tokens"] += s.num_generation_tokens
        t["prefix_queries"] += s.prefix_cache_queries
        t["prefix_hits"] += s.prefix_cache_hits
        t["running"], t["waiting"], t["kv_usage"] = s.num_running_reqs, s.num_waiting_reqs, s.kv_cache_usage
        loop = self.viewers.loop
        if not len(self.viewers) or loop is None:
            self.recorder.skip(so, outs)
            return
        now = time.monotonic()
        if now - self._last_sent < self.min_interval_s:
            self.recorder.skip(so, outs)
            if not self._flush_pending:  # the last steps of a burst still reach the totals
                self._flush_pending = True
                loop.call_soon_threadsafe(loop.call_later, self.min_interval_s, self._flush)
            return
        self._last_sent = now
        record = self.recorder.observe(so, outs, timings)
        record["totals"] = dict(t)
        loop.call_soon_threadsafe(self.viewers.send, sse_event("step", record))

    # -- the event loop ----------------------------------------------------------------------
    def _flush(self) -> None:
        asyncio.ensure_future(self._flush_now())

    async def _flush_now(self) -> None:
        """The totals and the cache after the last steps the sampling dropped (a burst's end)."""
        self._flush_pending = False
        snapshot = await self.llm.run(block_map, self.kv)
        self.viewers.send(sse_event("totals", {"v": SCHEMA_VERSION, "totals": dict(self.totals),
                                               "block_map": snapshot}))

    def stream(self) -> AsyncIterator[str]:
        self.recorder.request_block_map()  # the first record a new viewer gets has one
        return self.viewers.stream(self._hello, lambda: not self.llm.errored)

    async def _hello(self) -> dict[str, Any]:
        # The cache as it is now, read on the engine's thread (the only one that changes it).
        snapshot = await self.llm.run(block_map, self.kv)
        return {**self.header, "totals": dict(self.totals), "block_map": snapshot}


def make_feed(llm: AsyncLLM) -> tuple[TraceFeed | TraceFileFeed | None, str]:
    """The in-process observer when the scheduler is here, else the core's trace file."""
    try:
        return TraceFeed(llm), ""
    except AttributeError as e:  # the engine core runs in another process
        trace_file = llm.engine.config.observability_config.trace_file
        if trace_file:
            return TraceFileFeed(llm, trace_file), ""
        return None, (f"{e}; start the server with --trace-file PATH (the dashboard then reads "
                      "the core's step trace)")


def dashboard_router(llm: AsyncLLM) -> APIRouter:
    """The routes; ``build_app`` includes this router once."""
    router = APIRouter()
    feed, unavailable = make_feed(llm)

    @router.get("/dashboard", include_in_schema=False)
    async def dashboard() -> FileResponse:
        return FileResponse(STATIC_DIR / "dashboard.html", media_type="text/html")

    @router.get("/dashboard/static/{name}", include_in_schema=False)
    async def static_file(name: str) -> FileResponse:
        if name not in _STATIC_FILES:  # a fixed list: no path from the URL reaches the disk
            raise HTTPException(404, f"no dashboard file {name!r}")
        return FileResponse(STATIC_DIR / name, media_type=_STATIC_FILES[name])

    @router.get("/v1/trace/stream")
    async def trace_stream() -> StreamingResponse:
        if feed is None:
            raise HTTPException(503, f"the step trace stream is not available: {unavailable}")
        return StreamingResponse(feed.stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    router.trace_feed = feed  # type: ignore[attr-defined]  # tests read the viewer count
    return router
