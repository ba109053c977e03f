"""The worker process: builds one rank's runner and serves the executor's calls, in order.

Messages (msgpack through ``wire.Codec``), one reply per request:

    executor -> worker   [method, args]           method in ``CALLS``, or "shutdown" (no reply)
    worker -> executor   ["ready", pid]           once, after the runner is built
                         ["ok", result]           result is None on ranks > 0 for execute_model
                         ["error", error_info]    the exception, as data (see ``error_info``)

Everything here runs in the child; the executor side is ``multiproc.py``. ``Worker`` is the rank
itself (join the tensor-parallel group, build the runner, run calls); the Ray executor's actors
wrap the same class (``ray_executor.py``).
"""
from __future__ import annotations

import os
import signal
import sys
from typing import Any, Callable

import zmq

from pagedllm.distributed.launch import DistributedInit
from pagedllm.executor.ipc import Codec, error_info, parent_process
from pagedllm.executor.ipc import send_unless_orphaned as _send

# What the executor may call on the runner (the Runner protocol of pagedllm/runner/base.py).
CALLS = frozenset({"determine_num_blocks", "get_kv_cache_groups", "initialize_kv_cache",
                   "execute_model", "add_lora", "remove_lora"})


class Worker:
    """One rank, whatever carries its calls (the ZeroMQ loop below, or a Ray actor): joins the
    tensor-parallel group, builds the runner, runs the calls in the order they come."""

    def __init__(self, rank: int, runner_factory: Callable[[], Any],
                 distributed: DistributedInit | None = None) -> None:
        self.rank = rank
        self._in_group = distributed is not None and distributed.world_size > 1
        if self._in_group:
            # torch only here: a FakeRunner worker at world size 1 never imports it.
            from pagedllm.distributed.parallel_state import init_distributed

            init_distributed(distributed)  # before the model is built: layers size their shards
        self.runner = runner_factory()

    def call(self, method: str, args: list) -> Any:
        if method not in CALLS:
            raise ValueError(f"worker: unknown call {method!r}")
        result = getattr(self.runner, method)(*args)
        if method == "execute_model" and self.rank > 0:
            result = None  # every rank computes the step (and samples the same); rank 0 reports it
        return result

    def reply(self, codec: Codec, method: str, args: list) -> bytes:
        """The encoded reply to one call: ["ok", result] or ["error", error_info]."""
        try:
            return codec.encode(["ok", self.call(method, args)])
        except Exception as exc:  # the runner's error (or an unencodable result) goes back
            return codec.encode(["error", error_info(exc)])

    def close(self) -> None:
        if self._in_group:
            from pagedllm.distributed.parallel_state import destroy_distributed

            destroy_distributed()


def worker_main(rank: int, runner_factory: Callable[[], Any], request_addr: str,
                response_addr: str, distributed: DistributedInit | None = None) -> None:
    """Entry point of a worker process (``process.ChildProcess`` target; everything is picklable)."""
    # Ctrl-C reaches the whole process group; the engine decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    codec = Codec()
    ctx = zmq.Context()
    requests = ctx.socket(zmq.PULL)
    responses = ctx.socket(zmq.PUSH)
    requests.connect(request_addr)
    responses.connect(response_addr)
    try:
        exit_code = _serve(rank, runner_factory, distributed, codec, requests, responses)
    finally:
        requests.close(linger=0)
        # A moment to flush a last reply (an error report) if the engine still listens.
        responses.close(linger=1000)
        ctx.term()
    sys.exit(exit_code)


def _serve(rank: int, runner_factory: Callable[[], Any], distributed: DistributedInit | None,
           codec: Codec, requests: zmq.Socket, responses: zmq.Socket) -> int:
    """Serve calls until told to stop (exit code 0); 1 if the rank could not start."""
    # Never outlive the engine: watch the parent process while waiting and while sending.
    parent = parent_process()
    try:
        worker = Worker(rank, runner_factory, distributed)
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
            worker.close()
            return 0
        if not _send(responses, worker.reply(codec, method, args), parent):
            return 0  # the parent died while we were computing

