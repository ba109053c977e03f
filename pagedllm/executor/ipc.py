"""The public toolkit of pagedllm's child processes: what a rank's worker (worker.py) and the
engine core's process (engine/core_proc.py, engine/core_client.py) both need to start, talk to
and outlive each other: the child-process handle, the wire codec, a ZeroMQ context, a send that
gives up when the parent is gone, and exceptions carried as data and raised again.

The engine imports only this module and the package's ``create_executor``; the executors'
own modules stay theirs to change.
"""
from __future__ import annotations

import traceback
from typing import Any

import zmq

from pagedllm import errors
from pagedllm.errors import EngineDeadError, ValidationError
from pagedllm.executor.process import ChildProcess, parent_process
from pagedllm.executor.wire import Codec
from pagedllm.executor.zmq_context import new_context, term_context

__all__ = ["ChildProcess", "Codec", "RemoteTraceback", "error_info", "new_context", "parent_process",
           "remote_error", "send_unless_orphaned", "term_context"]


def error_info(exc: BaseException) -> dict[str, Any]:
    """An exception as plain data; ``remote_error`` turns it back into one."""
    return {"type": type(exc).__name__, "message": str(exc), "param": getattr(exc, "param", None),
            "traceback": "".join(traceback.format_exception(exc))}


class RemoteTraceback(Exception):
    """The child's traceback, chained as ``__cause__`` of the error the parent raises."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def remote_error(info: dict[str, Any], context: str) -> Exception:
    """Rebuild a child's exception: pagedllm's own errors keep their type and message (a
    ValidationError is still an HTTP 400); anything else means the child is broken."""
    cls = getattr(errors, info["type"], None)
    if isinstance(cls, type) and issubclass(cls, errors.PagedLLMError) and cls is not EngineDeadError:
        exc: Exception = (cls(info["message"], info["param"]) if issubclass(cls, ValidationError)
                          else cls(info["message"]))
    else:
        exc = EngineDeadError(f"{context}: {info['type']}: {info['message']}")
    exc.__cause__ = RemoteTraceback(info["traceback"])
    return exc


def send_unless_orphaned(sock: zmq.Socket, message: bytes, parent: Any) -> bool:
    """Send, unless the parent is gone (a PUSH with no peer would block forever)."""
    while True:
        try:
            sock.send(message, zmq.NOBLOCK)
            return True
        except zmq.Again:
            if parent is not None and not parent.is_alive():
                return False
            sock.poll(100, zmq.POLLOUT)
