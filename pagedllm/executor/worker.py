"""The worker process: builds one rank's runner and serves the executor's calls, in order.

Messages (msgpack through ``wire.Codec``), one reply per request:

    executor -> worker   [method, args]           method in ``CALLS``, or "shutdown" (no reply)
    worker -> executor   ["ready", pid]           once, after the runner is built
                         ["ok", result]           result is None on ranks > 0 for execute_model
                         ["error", error_info]    the exception, as data (see ``error_info``)

Everything here runs in the child; the executor side is ``multiproc.py``.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import traceback
from typing import Any, Callable

import zmq

from pagedllm.executor.wire import Codec

# What the executor may call on the runner (the Runner protocol of pagedllm/runner/base.py).
CALLS = frozenset({"determine_num_blocks", "initialize_kv_cache", "execute_model"})


def error_info(exc: BaseException) -> dict[str, Any]:
    """An exception as plain data; ``multiproc.remote_error`` turns it back into one."""
    return {"type": type(exc).__name__, "message": str(exc), "param": getattr(exc, "param", None),
            "traceback": "".join(traceback.format_exception(exc))}


def worker_main(rank: int, runner_factory: Callable[[], Any], request_addr: str,
                response_addr: str) -> None:
    """Entry point of a spawned worker (``multiprocessing`` target; everything is picklable)."""
    # Ctrl-C reaches the whole process group; the engine decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    codec = Codec()
    ctx = zmq.Context()
    requests = ctx.socket(zmq.PULL)
    responses = ctx.socket(zmq.PUSH)
    requests.connect(request_addr)
    responses.connect(response_addr)
    try:
        exit_code = _serve(rank, runner_factory, codec, requests, responses)
    finally:
        requests.close(linger=0)
        # A moment to flush a last reply (an error report) if the engine still listens.
        responses.close(linger=1000)
        ctx.term()
    sys.exit(exit_code)


def _serve(rank: int, runner_factory: Callable[[], Any], codec: Codec, requests: zmq.Socket,
           responses: zmq.Socket) -> int:
    """Serve calls until told to stop (exit code 0); 1 if the runner could not be built."""
    # Never outlive the engine: watch the parent process while waiting and while sending.
    parent = multiprocessing.parent_process()
    try:
        runner = runner_factory()
    except BaseException as exc:  # the executor re-raises it with this text
        _send(responses, codec.encode(["error", error_info(exc)]), parent)
        return 1
    if not _send(responses, codec.encode(["ready", os.getpid()]), parent):
        return 0
    poller = zmq.Poller()
    poller.register(requests, zmq.POLLIN)
    if parent is not None:
        poller.register(parent.sentinel, zmq.POLLIN)
    while True:
        ready = dict(poller.poll())
        if requests not in ready:
            return 0  # the parent died
        method, args = codec.decode(requests.recv())
        if method == "shutdown":
            return 0
        try:
            if method not in CALLS:
                raise ValueError(f"worker: unknown call {method!r}")
            result = getattr(runner, method)(*args)
            if method == "execute_model" and rank > 0:
                result = None  # every rank computes the step; rank 0 reports it
            reply = codec.encode(["ok", result])
        except Exception as exc:  # the runner's error (or an unencodable result) goes back
            reply = codec.encode(["error", error_info(exc)])
        if not _send(responses, reply, parent):
            return 0  # the parent died while we were computing


def _send(sock: zmq.Socket, message: bytes, parent: Any) -> bool:
    """Send, unless the parent is gone (a PUSH with no peer would block forever)."""
    while True:
        try:
            sock.send(message, zmq.NOBLOCK)
            return True
        except zmq.Again:
            if parent is not None and not parent.is_alive():
                return False
            sock.poll(100, zmq.POLLOUT)


# Public for the engine core process (engine/core_proc.py), which sends to its parent the same way.
send_unless_orphaned = _send
