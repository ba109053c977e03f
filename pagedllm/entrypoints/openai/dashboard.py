"""The live dashboard: ``GET /dashboard`` (static HTML + JS, no build step) fed by
``GET /v1/trace/stream``, a server-sent-events stream of step-trace records
(docs/trace_schema.md).

While someone watches, the engine core samples its steps (engine/trace_stream.py): at most
``max_records_per_s`` records a second, a block map at most once a second, each record riding on
its step's outputs, so it works the same with the core in this process or in its own
(``pagedllm serve``'s default), and a busy server is not slowed by its viewers. ``TraceFeed``
sees every step's outputs on the engine thread (``LLMEngine.output_observers``): it adds up the
totals from each step's SchedulerStats (counts since the server started, so the dashboard's
numbers stay exact and match /metrics although most steps are not sent) and passes the sampled
records to the event loop with ``call_soon_threadsafe``, into a bounded queue per viewer; a
viewer that falls behind loses records, never the engine time. When the last viewer leaves the
core stops sampling. Data-parallel replicas have no single trace: the feed then tails the
``--trace-file`` (trace_file_feed.py), and without one the stream answers 503 saying so.

``/v1/trace/stream`` sits under /v1, so with ``--api-key`` the app's key middleware (auth.py)
guards it like every other /v1 route; the page sends the key it is given (``?key=`` or the
key field) as a Bearer header.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, HTTPException
from fastapi.responses import FileResponse, StreamingResponse

from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.engine.step_trace import SCHEMA_VERSION
from pagedllm.entrypoints.openai.trace_file_feed import TraceFileFeed, new_totals
from pagedllm.entrypoints.openai.trace_viewers import TraceViewers, sse_event

STATIC_DIR = Path(__file__).parent / "static"
_STATIC_FILES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}


class TraceFeed:
    """The feed behind /v1/trace/stream, wherever the engine core runs (module docstring)."""

    def __init__(self, llm: AsyncLLM, max_records_per_s: float = 20.0) -> None:
        self.llm = llm
        self.core = llm.engine.engine_core
        if not hasattr(self.core, "set_trace_stream"):  # several replicas: no single trace
            raise AttributeError("the live trace follows one engine core, and this server runs "
                                 "data-parallel replicas")
        self.min_interval_s = 1.0 / max_records_per_s
        self.totals = new_totals()
        self.viewers = TraceViewers()
        self._last_sent = float("-inf")
        self._flush_pending = False
        llm.engine.output_observers.append(self)

    # -- the engine thread -------------------------------------------------------------------
    def __call__(self, outs: Any) -> None:
        """Every step's outputs: the totals from its stats; its record, if the core sampled it."""
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
            return
        record = outs.trace_record
        if record is None:
            if not self._flush_pending:  # the last steps of a burst still reach the totals
                self._flush_pending = True
                loop.call_soon_threadsafe(loop.call_later, self.min_interval_s, self._flush)
            return
        record["totals"] = dict(t)
        loop.call_soon_threadsafe(self.viewers.send, sse_event("step", record))

    # -- the event loop ----------------------------------------------------------------------
    def _flush(self) -> None:
        asyncio.ensure_future(self._flush_now())

    async def _flush_now(self) -> None:
        """The totals after the steps the sampling dropped; once the engine is idle (a burst's
        end) the cache too. Not while it is busy: the snapshot is a call into the core, on
        the engine thread, and sampled records carry block maps then anyway."""
        self._flush_pending = False
        if self.llm.errored:
            return
        event: dict[str, Any] = {"v": SCHEMA_VERSION, "totals": dict(self.totals)}
        if not self.llm.engine.has_unfinished_requests():
            event["block_map"] = (await self.llm.run(self.core.trace_snapshot))["block_map"]
        self.viewers.send(sse_event("totals", event))

    async def _hello(self) -> dict[str, Any]:
        # On (again): the core's next sampled record carries a block map for this viewer.
        await self.llm.run(self.core.set_trace_stream, True)
        snapshot = await self.llm.run(self.core.trace_snapshot)
        return {"v": SCHEMA_VERSION, "header": True, **snapshot, "totals": dict(self.totals)}

    async def stream(self) -> AsyncIterator[str]:
        try:
            async for event in self.viewers.stream(self._hello, lambda: not self.llm.errored):
                yield event
        finally:
            if not len(self.viewers) and not self.llm.errored:  # the last viewer left
                await self.llm.run(self.core.set_trace_stream, False)


def make_feed(llm: AsyncLLM) -> tuple[TraceFeed | TraceFileFeed | None, str]:
    """The core's sampled records; with data-parallel replicas, the core's trace file."""
    try:
        return TraceFeed(llm), ""
    except AttributeError as e:  # data-parallel replicas
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
