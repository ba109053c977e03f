"""EngineCoreClient, what the front end calls on an engine core; MPEngineCoreClient, the engine
core in a background process behind those methods.

``LLMEngine`` holds an ``EngineCore`` (in-process: ``LLM``, tests, notebooks) or this client
(serving), chosen by ``llm_engine.make_engine_core``: the ``PAGEDLLM_ENABLE_MULTIPROCESSING``
environment variable (vLLM's ``VLLM_ENABLE_V1_MULTIPROCESSING``), off unless a caller
(``pagedllm serve``) defaults it on. The core process is ``core_proc.run_engine_core``; the message format is in
that module's docstring.

* ``add_request`` is a request/reply: the core's admission check (a prompt that could never fit
  the KV cache, a beam search too wide...) needs the core's state, so the front gets the same
  ValidationError (type, message, ``param``) at the call, as in-process, and nothing is queued.
  It costs one round trip, taken between two steps of the core.
* ``abort_requests`` / ``finish_requests`` are fire-and-forget; the core takes them before its
  next step.
* ``step()`` returns the next EngineCoreOutputs the core pushed, blocking (a poll with a timeout,
  never a spin) while the core still has work, or None at once when nothing is pending.
* A dead core is noticed at once: every wait also watches the process sentinel, and a monitor
  thread calls ``on_dead`` callbacks (AsyncLLM fails every open stream and /health turns 503)
  even when nobody waits. Every later call raises EngineDeadError.

Calls come from one thread at a time (the engine thread; ZeroMQ sockets are not thread-safe);
``shutdown`` may come from any thread.
"""
from __future__ import annotations

import atexit
import logging
import shutil
import signal
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from multiprocessing.connection import wait as wait_for_sentinels
from typing import Any, Protocol, runtime_checkable

import zmq

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.core.outputs import EngineCoreOutputs, EngineCoreRequest
from pagedllm.engine.core_proc import run_engine_core
from pagedllm.errors import EngineDeadError
from pagedllm.executor.ipc import ChildProcess, Codec, RemoteTraceback, new_context, remote_error, term_context
from pagedllm.lora.request import LoRARequest
from pagedllm.runner.base import Runner

ENV_ENABLE_MULTIPROCESSING = envs.PAGEDLLM_ENABLE_MULTIPROCESSING
_POLL_MS = 100  # a blocked wait looks at shutdown this often (the sentinel wakes it at once)
logger = logging.getLogger("pagedllm")


@runtime_checkable
class EngineCoreClient(Protocol):
    """The engine core as LLMEngine drives it, wherever it runs: ``EngineCore`` (this process),
    ``MPEngineCoreClient`` (a process of its own), ``DPEngineCoreClient`` (one per replica).
    Extras some have (``on_dead``, ``trace_snapshot``, ``engine_index_of``) are probed by name."""

    num_blocks: int  # the KV cache's blocks (per replica): what one request may use at most

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a tokenized request, or raise its ValidationError (nothing queued)."""

    def abort_requests(self, request_ids: Iterable[str]) -> None: ...

    def finish_requests(self, request_ids: Iterable[str], stop_reason: str) -> None: ...

    def step(self) -> EngineCoreOutputs | None:
        """The next step's outputs; None while nothing has finished yet."""

    def has_unfinished_requests(self) -> bool: ...

    def reset_prefix_cache(self) -> bool: ...

    def get_metrics(self) -> dict[str, float]: ...

    def shutdown(self) -> None: ...


def multiprocessing_enabled(default: bool = False) -> bool:
    """``PAGEDLLM_ENABLE_MULTIPROCESSING`` (1/true/yes/on or 0/false/no/off), else ``default``."""
    return envs.enable_multiprocessing(default)


class MPEngineCoreClient:
    def __init__(self, config: EngineConfig, max_model_len: int, runner: Runner | None = None,
                 startup_timeout_s: float = 300.0, engine_index: int | None = None,
                 process_env: dict[str, str] | None = None) -> None:
        """``engine_index``: this core's data-parallel replica (named in its process and its
        errors); ``process_env``: environment variables set in the core process before it
        builds anything (a replica's share of the CPU threads)."""
        self._codec = Codec()
        self._outputs: deque[EngineCoreOutputs] = deque()
        self._sent_seq = 0  # inputs sent ...
        self._acked_seq = 0  # ... and the last one the core reported taking
        self._core_busy = False
        self._dead: EngineDeadError | None = None
        self._closing = False
        self._lock = threading.Lock()  # the sockets: the caller's thread, or shutdown
        self._death_lock = threading.Lock()
        self.on_dead: list[Callable[[EngineDeadError], None]] = []
        self._ipc_dir = tempfile.mkdtemp(prefix="pagedllm-core-")
        self._ctx = new_context()
        self._inputs, self._results = self._ctx.socket(zmq.PUSH), self._ctx.socket(zmq.PULL)
        input_addr, output_addr = f"ipc://{self._ipc_dir}/inputs", f"ipc://{self._ipc_dir}/outputs"
        self._inputs.bind(input_addr)
        self._results.bind(output_addr)
        # A fresh interpreter running pagedllm's entry module: the user's script is not re-run
        # there (a script may build its engine at top level). At exit, ask it to stop cleanly
        # (it reaps its own workers); were this process killed, the core sees its pipe close.
        self.engine_index = engine_index
        name = "pagedllm-engine-core" + ("" if engine_index is None else f"-{engine_index}")
        self._proc = ChildProcess(
            run_engine_core, (config, max_model_len, runner, input_addr, output_addr,
                              logging.getLogger().getEffectiveLevel()),
            name=name, env=process_env)
        atexit.register(self.shutdown)
        self._poller = zmq.Poller()
        self._poller.register(self._results, zmq.POLLIN)
        self._poller.register(self._proc.sentinel, zmq.POLLIN)
        try:
            ready = self._recv(deadline=time.monotonic() + startup_timeout_s)
            if ready is None:
                raise EngineDeadError(f"the engine core process did not start within {startup_timeout_s:.0f} s")
            kind, _, _, payload = ready
            if kind == "failed":
                raise remote_error(payload, "the engine core process failed to start")
            assert kind == "ready", kind
        except BaseException:
            self.shutdown()
            raise
        self.pid: int = payload["pid"]
        self.num_blocks: int = payload["num_blocks"]
        # The established ipc connections outlive their paths: nothing is left on disk.
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
        threading.Thread(target=self._monitor, name="pagedllm-core-monitor", daemon=True).start()

    # -- EngineCore's methods ----------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        self._call("add_request", request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self._send("abort_requests", list(request_ids))

    def finish_requests(self, request_ids: Iterable[str], stop_reason: str) -> None:
        self._send("finish_requests", list(request_ids), stop_reason)

    def reset_prefix_cache(self) -> bool:
        return self._call("reset_prefix_cache")

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self._call("add_lora", lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._call("remove_lora", lora_int_id)

    def list_loras(self) -> list[int]:
        return self._call("list_loras")

    def get_metrics(self) -> dict[str, float]:
        return self._call("get_metrics")

    def set_trace_stream(self, enabled: bool) -> None:
        self._send("set_trace_stream", enabled)

    def trace_snapshot(self) -> dict[str, Any]:
        return self._call("trace_snapshot")

    def has_unfinished_requests(self) -> bool:
        """Outputs still to come: some are here, the core said it is busy, or it has not yet
        reported on every input sent."""
        return bool(self._outputs) or self._core_busy or self._acked_seq < self._sent_seq

    def step(self) -> EngineCoreOutputs | None:
        """The next step's outputs the core pushed (waiting for them while it has work), or
        None when nothing is pending."""
        with self._lock:
            while not self._outputs:
                if not self.has_unfinished_requests():
                    return None
                self._recv()
            return self._outputs.popleft()

    # -- for a client over several cores (data parallel: dp_client.DPEngineCoreClient) ------
    @property
    def poll_handles(self) -> tuple[zmq.Socket, int]:
        """What to poll to know this core has news: its output socket and its process."""
        return self._results, self._proc.sentinel

    def try_step(self) -> EngineCoreOutputs | None:
        """A step's outputs if the core already pushed them, else None at once (never waits)."""
        with self._lock:
            self._check_alive()
            while not self._outputs and self._results.poll(0, zmq.POLLIN):
                self._recv()
            return self._outputs.popleft() if self._outputs else None

    def shutdown(self) -> None:
        """Ask the core to stop, then terminate, then kill; reap it. Idempotent, any thread."""
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.shutdown)
        # A wait in step() gives the lock up within _POLL_MS once _closing is set.
        have_lock = self._lock.acquire(timeout=2.0)
        if have_lock and self._proc.is_alive():
            try:
                self._inputs.send(self._codec.encode([self._sent_seq + 1, "shutdown", []]), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # not connected: it is going anyway
        self._proc.join(5.0)  # it finishes its step and stops its executor's workers
        if self._proc.is_alive():
            self._proc.terminate()  # SIGTERM: it still unwinds and reaps its workers
            self._proc.join(5.0)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        if have_lock:
            self._inputs.close(linger=0)
            self._results.close(linger=0)
            term_context(self._ctx)
            self._lock.release()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    # -- the wire ----------------------------------------------------------------------------
    def _send(self, method: str, *args: Any) -> None:
        self._check_alive()
        self._sent_seq += 1
        message = self._codec.encode([self._sent_seq, method, list(args)])
        while True:
            try:
                self._inputs.send(message, zmq.NOBLOCK)
                return
            except zmq.Again:  # no room (or no peer): wait a little, watching the core
                self._check_alive()
                self._inputs.poll(_POLL_MS, zmq.POLLOUT)

    def _call(self, method: str, *args: Any) -> Any:
        """Send and wait for the reply; the steps' outputs that arrive meanwhile are kept."""
        with self._lock:
            self._send(method, *args)
            seq = self._sent_seq
            while True:
                kind, got_seq, _, payload = self._recv()
                if kind in ("reply", "error") and got_seq == seq:
                    if kind == "error":
                        raise remote_error(payload, f"the engine core failed in {method}")
                    return payload

    def _recv(self, deadline: float | None = None) -> list | None:
        """The core's next message (outputs are also queued for step()); None past deadline;
        EngineDeadError as soon as the core process ends or reports a failure."""
        while True:
            if self._dead is not None or self._closing:
                self._check_alive()
            # Messages first: a core that failed says why ("failed") before its process ends.
            ready = dict(self._poller.poll(_POLL_MS))
            if self._results in ready:
                message = self._codec.decode(self._results.recv())
                kind, seq, busy, payload = message
                if kind == "failed" and deadline is None:  # after startup: the core broke
                    raise self._died(_failure(payload))
                self._acked_seq, self._core_busy = seq, busy
                if kind == "outputs" and payload is not None:
                    self._outputs.append(payload)
                return message
            if ready:  # the sentinel: the process ended
                self._check_alive()
            if deadline is not None and time.monotonic() >= deadline:
                return None

    # -- a dead core -------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._closing:
            raise EngineDeadError("the engine core was shut down")
        if not self._proc.is_alive():
            raise self._died(EngineDeadError(self._how_it_ended()))

    def _how_it_ended(self) -> str:
        code = self._proc.exitcode
        how = (f"was killed by signal {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exited with code {code}")
        which = "" if self.engine_index is None else f" of data-parallel replica {self.engine_index}"
        return (f"the engine core process{which} (pid {self._proc.pid}) {how}; every open request failed "
                f"and the engine cannot continue (restart it)")

    def _died(self, error: EngineDeadError) -> EngineDeadError:
        """Record the first death (once) and tell the callbacks; returns the error to raise."""
        with self._death_lock:
            if self._dead is not None:
                return self._dead
            self._dead = error
        logger.error("%s", error)
        for callback in self.on_dead:
            try:
                callback(error)
            except Exception:  # noqa: BLE001 - one callback's failure does not hide the death
                logger.exception("an engine core death callback failed")
        return error

    def _monitor(self) -> None:
        """Wait for the process to end; if nobody shut it down, it died: with the reason it
        sent last, if any (an idle core whose worker died says so), else how it ended."""
        wait_for_sentinels([self._proc.sentinel])
        if self._closing:
            return
        self._proc.join(1.0)  # its exit code, for the message
        if self._lock.acquire(timeout=1.0):  # else the caller's thread is reading: it finds it
            try:
                while self._dead is None and self._results.poll(0, zmq.POLLIN):
                    kind, _, _, payload = self._codec.decode(self._results.recv())
                    if kind == "failed":
                        self._died(_failure(payload))
            finally:
                self._lock.release()
        self._died(EngineDeadError(self._how_it_ended()))


def _failure(info: dict[str, Any]) -> EngineDeadError:
    error = EngineDeadError(f"the engine core failed: {info['type']}: {info['message']}")
    error.__cause__ = RemoteTraceback(info["traceback"])
    return error
