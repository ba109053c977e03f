"""MultiprocExecutor: one worker process per rank, spoken to over ZeroMQ with msgpack.

Each rank has a pair of ipc sockets: the executor PUSHes requests (``worker.py`` lists them)
and PULLs replies. Calls are lockstep: the same encoded message goes to every rank, then one
reply is read from each, so a rank handles its SchedulerOutputs strictly in order.

Workers are fresh interpreters running pagedllm's own entry module (``process.ChildProcess``),
never forks (a fork of a process that holds torch threads or a CUDA context can deadlock) and
never multiprocessing's spawn (which re-runs the user's script in the child). Waiting for a
reply also watches every worker's process sentinel (a file descriptor that becomes readable
when the process ends), so a dead worker wakes the engine at once with EngineDeadError instead
of leaving it blocked on a socket nobody will write to.

Calls must not overlap (ZeroMQ sockets are not thread-safe): one thread at a time, e.g. the
engine loop, or the one thread it hands steps to. ``check_health`` touches only process state
and may be called from any thread.
"""
from __future__ import annotations

import shutil
import signal
import tempfile
import time
import weakref
from multiprocessing.connection import wait as wait_for_sentinels
from typing import Any

import msgpack
import zmq

from pagedllm.distributed.launch import DistributedInit, get_open_port
from pagedllm.errors import EngineDeadError
from pagedllm.executor.abstract import RankGroupExecutor, RunnerFactory
from pagedllm.executor.ipc import ChildProcess, Codec, new_context, remote_error, term_context
from pagedllm.executor.worker import worker_main

_SHUTDOWN = msgpack.packb(["shutdown", []])


class MultiprocExecutor(RankGroupExecutor):
    """``world_size`` ranks on this machine; above 1 they form a tensor-parallel group (gloo or
    NCCL, per ``device``) at ``master_addr``:``master_port`` (a free port unless given) before
    building their runners, and give up with a message after ``init_timeout_s``."""

    def __init__(self, runner_factory: RunnerFactory, world_size: int = 1,
                 startup_timeout_s: float = 300.0, *, device: str = "auto",
                 master_addr: str = "127.0.0.1", master_port: int | None = None,
                 init_timeout_s: float = 120.0) -> None:
        assert world_size >= 1, world_size
        self.world_size = world_size
        self._launch = (device, master_addr, master_port, init_timeout_s)
        self._codec = Codec()
        self._failure: str | None = None  # once a rank failed, every call raises this
        self._is_shut_down = False
        self._started = False  # every rank reported ready
        self._procs: list[ChildProcess] = []
        self._requests: list[zmq.Socket] = []
        self._responses: list[zmq.Socket] = []
        self._ipc_dir = tempfile.mkdtemp(prefix="pagedllm-executor-")
        self._zmq = new_context()
        # Runs once: from shutdown(), when the executor is garbage collected, or at exit.
        self._finalizer = weakref.finalize(self, _release, self._procs, self._requests,
                                           self._responses, self._zmq, self._ipc_dir)
        try:
            self._start_workers(runner_factory, startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    # -- startup ----------------------------------------------------------------------------
    def _start_workers(self, runner_factory: RunnerFactory, timeout_s: float) -> None:
        device, master_addr, master_port, init_timeout_s = self._launch
        if self.world_size > 1 and master_port is None:
            master_port = get_open_port(master_addr)
        for rank in range(self.world_size):
            distributed = (None if self.world_size == 1 else
                           DistributedInit(rank, self.world_size, master_addr, master_port, device,
                                           local_rank=rank, local_world_size=self.world_size,
                                           timeout_s=init_timeout_s))
            request_addr = f"ipc://{self._ipc_dir}/requests-{rank}"
            response_addr = f"ipc://{self._ipc_dir}/responses-{rank}"
            self._requests.append(self._zmq.socket(zmq.PUSH))
            self._responses.append(self._zmq.socket(zmq.PULL))
            self._requests[rank].bind(request_addr)
            self._responses[rank].bind(response_addr)
            self._procs.append(ChildProcess(
                worker_main, (rank, runner_factory, request_addr, response_addr, distributed),
                name=f"pagedllm-worker-{rank}"))
        # One poller per rank: its replies, and every worker's end.
        self._pollers = []
        for rank in range(self.world_size):
            poller = zmq.Poller()
            poller.register(self._responses[rank], zmq.POLLIN)
            for proc in self._procs:
                poller.register(proc.sentinel, zmq.POLLIN)
            self._pollers.append(poller)
        deadline = time.monotonic() + timeout_s
        for rank in range(self.world_size):
            reply = self._recv(rank, deadline)
            if reply is None:
                raise EngineDeadError(f"worker rank {rank} did not start within {timeout_s:.0f} s")
            kind, payload = reply
            if kind == "error":
                raise remote_error(payload, f"worker rank {rank} failed to start")
            assert kind == "ready", kind
        self._started = True
        # Every connection is up: the socket files are needed no more (an established ipc
        # connection outlives its path), and an engine killed -9 now leaves nothing behind.
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    # -- the Executor interface -------------------------------------------------------------
    def _check_ranks(self) -> None:
        self._check_alive()

    def shutdown(self) -> None:
        self._is_shut_down = True
        self._finalizer()

    @property
    def worker_pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]

    # -- the calls --------------------------------------------------------------------------
    def _call(self, method: str, *args: Any) -> list[Any]:
        """Send one call to every rank and return every rank's result (rank order)."""
        self.check_health()
        message = self._codec.encode([method, list(args)])
        for rank in range(self.world_size):
            self._send(rank, message)
        # Read every rank's reply before raising, so no stale reply is left on a socket.
        replies = [self._recv(rank) for rank in range(self.world_size)]
        for rank, (kind, payload) in enumerate(replies):
            if kind == "error":
                if self.world_size > 1:
                    # A rank whose peer died mid-collective fails too ("connection closed by
                    # peer"): name the dead rank, the cause, rather than the survivor.
                    wait_for_sentinels([p.sentinel for p in self._procs], timeout=1.0)
                    self._check_alive()
                exc = remote_error(payload, f"worker rank {rank} failed in {method}")
                # The rank's state after a failed step is unknown: the executor stays failed.
                self._failure = f"worker rank {rank} failed in {method}: {exc}"
                raise exc
        return [payload for _, payload in replies]

    def _send(self, rank: int, message: bytes) -> None:
        sock = self._requests[rank]
        while True:
            try:
                sock.send(message, zmq.NOBLOCK)
                return
            except zmq.Again:
                # No connected peer to take it: the worker is gone (or going). Wait a little for
                # room, checking that every worker is still there.
                self._check_alive()
                sock.poll(100, zmq.POLLOUT)

    def _recv(self, rank: int, deadline: float | None = None) -> Any:
        """Rank's next reply; EngineDeadError as soon as any worker ends; None past deadline."""
        while True:
            timeout_ms = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            ready = dict(self._pollers[rank].poll(timeout_ms))
            if self._responses[rank] in ready:
                return self._codec.decode(self._responses[rank].recv())
            if ready:  # a sentinel: some worker ended
                self._check_alive()
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def _check_alive(self) -> None:
        for rank, proc in enumerate(self._procs):
            if proc.is_alive():
                continue
            last_words = self._last_error(rank)
            if last_words is not None:  # it said why before it went (a failed startup does)
                self._failure = (f"worker rank {rank} failed: {last_words['type']}: "
                                 f"{last_words['message']}")
                raise remote_error(last_words, f"worker rank {rank} failed")
            code = proc.exitcode
            how = (f"killed by signal {signal.Signals(-code).name}" if code is not None and code < 0
                   else f"exited with code {code}")
            if self._started:
                self._failure = (f"worker rank {rank} (pid {proc.pid}) {how}; the engine cannot "
                                 f"continue (restart it)")
            else:
                self._failure = (f"worker rank {rank} (pid {proc.pid}) {how} before it was ready "
                                 f"(its stderr says why)")
            raise EngineDeadError(self._failure)

    def _last_error(self, rank: int) -> dict[str, Any] | None:
        """The error report an ended worker left unread on its socket, if any."""
        sock = self._responses[rank]
        while sock.poll(0):
            kind, payload = self._codec.decode(sock.recv())
            if kind == "error":
                return payload
        return None


def _release(procs: list, requests: list[zmq.Socket], responses: list[zmq.Socket],
             ctx: zmq.Context, ipc_dir: str) -> None:
    """Stop the workers (ask, then terminate, then kill), close the sockets, remove the ipc
    folder. A module function, so the finalizer does not keep the executor alive."""
    asked = []
    for sock in requests:
        try:
            sock.send(_SHUTDOWN, zmq.NOBLOCK)
            asked.append(True)
        except zmq.ZMQError:
            asked.append(False)  # not connected (gone, or still starting): no use waiting
    deadline = time.monotonic() + 2.0
    for proc, was_asked in zip(procs, asked):
        if was_asked:
            proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(1.0)
        if proc.is_alive():
            proc.kill()
            proc.join()
        proc.close()  # releases its sentinel
    for sock in requests + responses:
        sock.close(linger=0)
    term_context(ctx)
    shutil.rmtree(ipc_dir, ignore_errors=True)
