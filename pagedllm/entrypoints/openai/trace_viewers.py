"""The viewers of /v1/trace/stream: one bounded queue per open stream, fed on the event loop.

A feed (the in-process step observer in dashboard.py, or the trace-file tail in
trace_file_feed.py) calls ``send`` on the event loop; each viewer's ``stream()`` yields
server-sent events. A viewer that falls behind loses its oldest records, so no feed ever waits
for a browser.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

KEEPALIVE_S = 15.0
_QUEUE_SIZE = 256


def sse_event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


class TraceViewers:
    def __init__(self) -> None:
        self._queues: set[asyncio.Queue[str]] = set()
        self.loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        return len(self._queues)

    def send(self, message: str) -> None:
        """On the event loop: hand a message to every viewer."""
        for queue in self._queues:
            if queue.full():  # a slow viewer loses its oldest record, nobody waits
                queue.get_nowait()
            queue.put_nowait(message)

    async def stream(self, hello: Callable[[], Awaitable[dict[str, Any]]],
                     alive: Callable[[], bool]) -> AsyncIterator[str]:
        """One viewer: the ``hello`` event first, then what is sent, while ``alive()``."""
        self.loop = asyncio.get_running_loop()
        queue: asyncio.Queue[str] = asyncio.Queue(_QUEUE_SIZE)
        self._queues.add(queue)
        try:
            yield sse_event("hello", await hello())
            idle = 0.0
            while alive():  # a stopped engine ends the stream (server shutdown)
                try:
                    yield await asyncio.wait_for(queue.get(), 1.0)
                    idle = 0.0
                except asyncio.TimeoutError:
                    idle += 1.0
                    if idle >= KEEPALIVE_S:  # proxies close silent connections
                        idle = 0.0
                        yield ": keepalive\n\n"
        finally:
            self._queues.discard(queue)
