"""The dashboard's feed when the engine core runs in its own process (``pagedllm serve``'s
default): the API process has no scheduler to observe, so it tails the step trace the core
writes (``--trace-file``, docs/trace_schema.md).

Every line is read, so the totals are exact; at most ``max_records_per_s`` records a second go
to the viewers (the file already carries a block map at most once a second). Reading happens on
the event loop in small non-blocking chunks, only while someone watches.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.entrypoints.openai.trace_viewers import TraceViewers, sse_event

POLL_S = 0.1
_CHUNK = 1 << 20


def new_totals() -> dict[str, float]:
    return {"steps": 0, "finished": 0, "preempted": 0, "prompt_tokens": 0, "generation_tokens": 0,
            "prefix_queries": 0, "prefix_hits": 0, "running": 0, "waiting": 0, "kv_usage": 0.0}


def add_record(totals: dict[str, float], rec: dict[str, Any]) -> None:
    """A step record into the totals (the counts the in-process feed takes from SchedulerStats;
    finishes outside the scheduler's update, reason "external", are not counted there either)."""
    totals["steps"] += 1
    totals["finished"] += sum(1 for f in rec["finished"] if f["reason"] != "external")
    totals["preempted"] += len(rec["preempted"])
    totals["prompt_tokens"] += rec["tokens"]["prompt"]
    totals["generation_tokens"] += rec["tokens"]["generation"]
    totals["prefix_queries"] += rec["prefix_cache"]["queries"]
    totals["prefix_hits"] += rec["prefix_cache"]["hits"]
    totals["running"], totals["waiting"] = rec["queues"]["running"], rec["queues"]["waiting"]
    totals["kv_usage"] = rec["kv_usage"]


class TraceFileFeed:
    def __init__(self, llm: AsyncLLM, path: str, max_records_per_s: float = 20.0) -> None:
        self.llm = llm
        self.path = path
        self.min_interval_s = 1.0 / max_records_per_s
        self.viewers = TraceViewers()
        self.header: dict[str, Any] = {"v": 1, "header": True}
        self.totals = new_totals()
        self.block_map: dict[str, Any] | None = None
        self._offset = 0
        self._partial = b""
        self._new_map = False
        self._task: asyncio.Task | None = None

    def stream(self) -> AsyncIterator[str]:
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._tail())
        return self.viewers.stream(self._hello, lambda: not self.llm.errored)

    async def _hello(self) -> dict[str, Any]:
        self._read_new()  # catch up first: exact totals and the latest block map
        return {**self.header, "totals": dict(self.totals), "block_map": self.block_map,
                "source": self.path}

    async def _tail(self) -> None:
        last_sent, pending = float("-inf"), False
        seen = time.monotonic()  # a viewer was here (it may not have registered yet)
        while len(self.viewers) or time.monotonic() - seen < 5.0:
            newest = self._read_new()
            now = time.monotonic()
            if len(self.viewers):
                seen = now
            if newest is not None:
                pending = True
            if pending and now - last_sent >= self.min_interval_s:
                if newest is not None:
                    newest["totals"] = dict(self.totals)
                    if self._new_map:  # the file's maps come at most once a second
                        newest["block_map"], self._new_map = self.block_map, False
                    self.viewers.send(sse_event("step", newest))
                else:
                    self.viewers.send(sse_event("totals", {"v": 1, "totals": dict(self.totals),
                                                           "block_map": self.block_map}))
                last_sent, pending = now, False
            await asyncio.sleep(POLL_S)

    def _read_new(self) -> dict[str, Any] | None:
        """Read what the core appended since the last call; returns the newest step record."""
        newest = None
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunks = []
                while chunk := f.read(_CHUNK):
                    chunks.append(chunk)
        except OSError:
            return None
        data = b"".join(chunks)
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()  # a line the core has not finished writing
        for line in lines:
            if not line.strip():
                continue
            rec = json.loads(line)
            if rec.get("header"):
                self.header = rec
                continue
            add_record(self.totals, rec)
            if "block_map" in rec:
                self.block_map, self._new_map = rec.pop("block_map"), True
            newest = rec
        return newest
