"""term_context: a context that cannot end does not hang its owner."""
from __future__ import annotations

import time

import zmq

from pagedllm.executor.zmq_context import new_context, term_context


def test_new_context_drops_unsent_messages_so_term_ends():
    ctx = new_context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect("tcp://127.0.0.1:1")  # nobody listens: the message stays queued
    sock.send(b"never delivered", zmq.NOBLOCK)
    sock.close()  # no linger given: the context's 0 applies (libzmq's default would block)
    assert term_context(ctx, timeout_s=5.0)
    assert ctx.closed


def test_term_context_gives_up_on_a_context_that_blocks():
    ctx = new_context()
    sock = ctx.socket(zmq.PULL)  # left open: zmq_ctx_term blocks until it is closed
    started = time.monotonic()
    assert not term_context(ctx, timeout_s=0.2)
    assert time.monotonic() - started < 2.0
    sock.close()  # lets the background term finish (zmq_ctx_term interrupted the socket)
