"""Ending a ZeroMQ context without ever hanging the process that owns it.

``zmq_ctx_term`` blocks until libzmq's reaper thread has finished closing every socket. With
every socket closed at linger 0 that is immediate by the documentation, yet on a CI run it once
blocked for ten minutes after a worker was killed -9 mid-step (libzmq 4.3.5; not reproduced in
hundreds of runs since). An engine that cannot shut down is worse than a context left to the
process's exit, so the term runs on a daemon thread and is given a bounded wait.
"""
from __future__ import annotations

import logging
import threading

import zmq

logger = logging.getLogger(__name__)


def new_context() -> zmq.Context:
    """A context whose sockets drop unsent messages on close unless told otherwise."""
    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)
    return ctx


def term_context(ctx: zmq.Context, timeout_s: float = 5.0) -> bool:
    """``ctx.term()``, waiting at most ``timeout_s``; False (and a warning) if it did not end."""
    thread = threading.Thread(target=ctx.term, name="pagedllm-zmq-term", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        logger.warning("the ZeroMQ context did not terminate within %.0f s; leaving it to the "
                       "process's exit", timeout_s)
        return False
    return True
