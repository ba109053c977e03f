"""EngineCoreProc: the engine core's busy loop in a process of its own (serving).

The API process (``core_client.MPEngineCoreClient``) starts ``run_engine_core`` in a process, which builds an
``EngineCore`` and then loops: take every input waiting on the input socket, step while there is
work, push each step's ``EngineCoreOutputs`` back. Nothing here waits for the API process, so
tokenization, detokenization and HTTP there never hold the model up.

Messages (msgpack through ``executor.wire.Codec``; both ends run the same code):

    client -> core   [seq, method, args]        method in ``CALLS``, or "shutdown"
    core -> client   [kind, seq, busy, payload]

``seq`` numbers the client's inputs; every message from the core carries the last one it took,
and ``busy`` (does the core still have work), so the client knows exactly whether outputs are
still to come (``MPEngineCoreClient.has_unfinished_requests``). Kinds: "ready" (payload: pid,
num_blocks), "outputs" (an EngineCoreOutputs, or None for a status report when the core went
idle), "reply" (a call's result), "error" (a call's exception as data; the core lives on),
"failed" (the core itself broke: the exception as data, then the process exits).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any

import zmq

from pagedllm.engine.engine_core import EngineCore
from pagedllm.executor.ipc import Codec, error_info, parent_process, send_unless_orphaned

# Calls answered with a "reply"/"error" message; the rest are fire-and-forget.
CALLS_WITH_REPLY = frozenset({"add_request", "reset_prefix_cache", "get_metrics", "trace_snapshot",
                              "add_lora", "remove_lora", "list_loras"})
CALLS = CALLS_WITH_REPLY | {"abort_requests", "finish_requests", "set_trace_stream"}
# An idle core wakes this often to check its workers: a rank that died between requests is
# reported (and /health turns 503) without waiting for the next request to find it.
IDLE_HEALTH_CHECK_MS = 1000


class EngineCoreProc:
    """The loop around one EngineCore; ``run()`` returns when told to stop or orphaned."""

    def __init__(self, core: EngineCore, codec: Codec, inputs: zmq.Socket, outputs: zmq.Socket) -> None:
        self.core = core
        self.codec = codec
        self.inputs = inputs
        self.outputs = outputs
        self.parent = parent_process()
        self.poller = zmq.Poller()
        self.poller.register(inputs, zmq.POLLIN)
        if self.parent is not None:
            self.poller.register(self.parent.sentinel, zmq.POLLIN)
        self.last_seq = 0
        self._reported: tuple[int, bool] = (0, False)  # (seq, busy) the client last heard

    def run(self) -> None:
        while True:
            # Idle: sleep until an input arrives (or the API process ends); busy: just look.
            busy = self.core.has_unfinished_requests()
            ready = dict(self.poller.poll(0 if busy else IDLE_HEALTH_CHECK_MS))
            if self.parent is not None and self.parent.sentinel in ready:
                return  # the API process is gone: nobody to serve
            if not busy and not ready:
                self.core.executor.check_health()  # EngineDeadError: reported as the core's failure
            if not self._take_inputs():
                return
            if self.core.has_unfinished_requests():
                step_outputs = self.core.step()
                if step_outputs is not None:  # None: async scheduling's first step
                    self._send("outputs", step_outputs)
            elif self._reported != (self.last_seq, False):
                self._send("outputs", None)  # went idle: say so, or the client waits forever

    def _take_inputs(self) -> bool:
        """Handle every input already queued, in order; False when told to shut down."""
        while True:
            try:
                data = self.inputs.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            seq, method, args = self.codec.decode(data)
            self.last_seq = seq
            if method == "shutdown":
                return False
            try:
                if method not in CALLS:
                    raise ValueError(f"engine core: unknown call {method!r}")
                result = getattr(self.core, method)(*args)
            except Exception as exc:  # noqa: BLE001 - the caller gets it (a ValidationError: a 400)
                if method not in CALLS_WITH_REPLY:
                    raise  # an abort or finish that fails means the core's state is broken
                self._send("error", error_info(exc))
                continue
            if method in CALLS_WITH_REPLY:
                self._send("reply", result)

    def _send(self, kind: str, payload: Any) -> None:
        busy = self.core.has_unfinished_requests()
        if not send_unless_orphaned(self.outputs, self.codec.encode([kind, self.last_seq, busy, payload]),
                                    self.parent):
            raise SystemExit(0)  # the API process died while we were sending
        self._reported = (self.last_seq, busy)


def run_engine_core(config: Any, max_model_len: int, runner: Any, input_addr: str, output_addr: str,
                    log_level: int = logging.WARNING) -> None:
    """Entry point of the engine core process (``process.ChildProcess``; every argument pickles)."""
    # Ctrl-C reaches the whole process group: the API process decides when the core stops.
    # SIGTERM (the client's way to stop a core that does not answer) unwinds through the
    # finally below, so the executor's own worker processes are reaped too.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s[core]: %(message)s")
    codec = Codec()
    ctx = zmq.Context()
    inputs, outputs = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inputs.connect(input_addr)
    outputs.connect(output_addr)
    try:
        exit_code = _serve(config, max_model_len, runner, codec, inputs, outputs)
    finally:
        inputs.close(linger=0)
        outputs.close(linger=1000)  # a moment to flush the last words
        ctx.term()
    sys.exit(exit_code)


def _serve(config: Any, max_model_len: int, runner: Any, codec: Codec, inputs: zmq.Socket,
           outputs: zmq.Socket) -> int:
    """Build the core and run its loop; the exit code (1: the core could not start or failed)."""
    parent = parent_process()
    try:
        core = EngineCore(config, max_model_len, runner)
    except BaseException as exc:  # the client re-raises it: a ValidationError stays one
        send_unless_orphaned(outputs, codec.encode(["failed", 0, False, error_info(exc)]), parent)
        return 1
    try:
        ready = {"pid": os.getpid(), "num_blocks": core.num_blocks}
        if not send_unless_orphaned(outputs, codec.encode(["ready", 0, False, ready]), parent):
            return 0
        loop = EngineCoreProc(core, codec, inputs, outputs)
        try:
            loop.run()
        except Exception as exc:  # noqa: BLE001 - a failed step: every open request fails
            logging.getLogger("pagedllm").exception("the engine core failed")
            send_unless_orphaned(outputs, codec.encode(["failed", loop.last_seq, False,
                                                        error_info(exc)]), parent)
            return 1
        return 0
    finally:
        core.shutdown()  # the executor's workers, the step trace's file


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(0)
