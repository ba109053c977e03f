"""Limits on what one HTTP connection may cost before a handler sees it.

* :class:`BodyLimitMiddleware`: a request body larger than ``max_body_bytes`` gets 413 (from its
  Content-Length at once, or as soon as a chunked body passes the limit), and a body that stops
  arriving for ``body_timeout`` seconds gets 408. The body is read here, whole (FastAPI reads it
  whole anyway before parsing JSON), then handed on; later ``receive()`` calls go to the server,
  so the handlers still see the client's disconnect.
* :class:`HeaderTimeoutH11Protocol`: uvicorn's h11 protocol plus a deadline for the request
  line and headers. uvicorn times out idle keep-alive connections, but a client that sends half
  a header block and stalls ("slowloris") holds its connection forever; here it is closed after
  ``header_timeout`` seconds.
"""
from __future__ import annotations

import asyncio
from typing import Any

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedllm.entrypoints.openai.auth import error_responder


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int, body_timeout: float) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout

    def _too_large(self, scope: Scope) -> Any:
        return error_responder(scope)(413, f"the request body is larger than {self.max_body_bytes} "
                                           "bytes (the server's --max-request-body-bytes)")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await self._too_large(scope)(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout)
            except asyncio.TimeoutError:
                await error_responder(scope)(408, f"the request body did not arrive within "
                                                  f"{self.body_timeout:g} s")(scope, receive, send)
                return
            if message["type"] == "http.disconnect":
                return  # the client is gone: nothing to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._too_large(scope)(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, replay_body(b"".join(chunks), receive), send)


def replay_body(body: bytes, receive: Receive) -> Receive:
    """A receive that gives ``body`` (read already) as one message, then hands on to ``receive``,
    so the app still sees the client's disconnect."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class HeaderTimeoutH11Protocol(H11Protocol):
    """Closes a connection whose request line and headers take longer than ``header_timeout``
    (set on the class by :func:`header_timeout_protocol`)."""

    header_timeout: float = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and data:
            self._arm_header_timer()  # a request has begun, its headers are not complete yet
        else:
            self._cancel_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()  # no request started in time: nothing to answer


def header_timeout_protocol(header_timeout: float) -> type[H11Protocol]:
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout": header_timeout})
