"""torch.compile of the model's forward: one graph for every token count, compiled at startup.

What gets compiled: ``model.forward(input_ids [T], positions [T]) -> hidden [T, hidden]``, the
decoder stack. Inductor fuses the elementwise work between the matmuls (RMSNorm, rotary, the
gated activation, residual adds) into a few C++ loops; attention is one opaque custom op per
layer (``pagedllm::attention``, layers/attention/layer.py) that reads the step's metadata from
the forward context, so no per-step Python object enters the graph and nothing graph-breaks.
``compute_logits`` (a matmul over the few rows that sample) and the sampler stay eager.

Dynamic token counts: the token dimension of both inputs is marked *unbacked* (vLLM marks it
dynamic). A merely dynamic ("backed") size still gets specialised at 0 and 1, so a step with a
single decoding request would compile a second graph mid-run; an unbacked size has no such
special case: one graph serves T = 1 .. max_num_batched_tokens, traced once at warm-up.

When it is on (``enforce_eager``): True never compiles; False, or unset (auto, the default, as
in vLLM), compiles wherever a compiler exists: inductor on CPU needs a C++ compiler, on CUDA
Triton; without one, the engine logs a line and runs eagerly. The environment variable
``PAGEDLLM_ENFORCE_EAGER=1`` makes unset mean eager: the test suite sets it (tests/conftest.py),
as vLLM's CPU CI runs eagerly, because each engine would otherwise spend seconds compiling.

On CPU the linears that hold packed weights (the skinny kernel, weight_plan/linear_choice.py chooses
them) are each an opaque op in the graph, as in eager mode; inductor fuses what lies between them,
so compiled steps beat eager ones at decode and prefill (``python -m benchmarks.compile_ab``;
the figures: docs/cpu_kernels.md#the-compiled-graph). Lowered by inductor instead, a linear
became a plain sgemm that re-packs the weight every call. The inductor cache lives in a folder
per build of the kernels under torch's default (``use_own_inductor_cache``).
"""
from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import time
import types
import weakref
from collections.abc import Callable

import torch

from pagedllm import envs
from pagedllm.kernels.cpu_extension import build_tag
from pagedllm.runner.compile_release import release_compiled_code
from pagedllm.runner.graph_call import GraphCall
from pagedllm.runner.loop_threads import loop_threads

logger = logging.getLogger(__name__)

ENV_ENFORCE_EAGER = envs.PAGEDLLM_ENFORCE_EAGER


def compile_disabled_reason(enforce_eager: bool | None, device: torch.device) -> str | None:
    """Why the model should run eagerly, or None when it should be compiled."""
    if enforce_eager:
        return "enforce_eager is set"
    if enforce_eager is None and envs.enforce_eager():
        return f"{ENV_ENFORCE_EAGER} is set and enforce_eager is not (enforce_eager=False compiles)"
    if device.type == "cpu":
        compiler = envs.cxx()
        if shutil.which(compiler) is None:
            return f"inductor needs a C++ compiler on CPU and {compiler!r} is not on PATH"
    elif device.type == "cuda":
        if importlib.util.find_spec("triton") is None:
            return "inductor needs Triton on CUDA and it is not installed"
    else:
        return f"no compiled mode on {device.type}"
    return None


def use_own_inductor_cache() -> str:
    """Point inductor's cache at a folder of this version of pagedllm's kernels (unless the user
    chose one with TORCHINDUCTOR_CACHE_DIR) and return it. Inductor's FX graph cache keys a
    graph by its code, not by the schemas of the custom ops it calls: after an argument of
    ``pagedllm::quant_linear`` was renamed, a graph that an older checkout had cached on the same
    machine was hit and its generated code called the op by the old name, and every compiled
    step failed ("Unknown keyword argument 'int8_activations'"). The ops' schemas live in the
    kernels' sources, so a folder per build tag keeps graphs apart across versions (vLLM keeps
    its compile cache by a hash of its code for the same reason)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    default = os.path.abspath(default_cache_dir())
    chosen = envs.torchinductor_cache_dir()
    if chosen is None or os.path.abspath(chosen) == default:  # unset, or torch's own default
        chosen = os.path.join(default, f"pagedllm-{build_tag()}")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = chosen
    return chosen


def _mark_tokens_unbacked(*tensors: torch.Tensor) -> None:
    for t in tensors:
        torch._dynamo.decorators.mark_unbacked(t, 0)


class CompiledForward:
    """``model.forward`` through torch.compile; call it like the model.

    ``warmup`` traces and compiles once (before the KV cache exists: outside a forward context
    attention runs without the cache, and the op hides the difference from the graph)."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model = model
        self.compile_seconds = 0.0
        self._warm = False
        # Once warm: the compiled graph called on the tensors it reads, without dynamo (__call__).
        self._call: GraphCall | None = None
        # fullgraph: a graph break would be a silent slowdown (and a second graph); fail loudly.
        # dynamic=False: only the token dimension is symbolic, marked per call below.
        # No size/alignment asserts: the generated wrapper checks every output of every opaque op
        # (attention, the packed linears) against its fake implementation on every call, a cost
        # on every step (docs/cpu_kernels.md#the-compiled-graph); tests/runner/test_compile.py
        # holds the compiled outputs to the eager ones instead.
        # cpp_wrapper on CPU: the graph's wrapper (which allocates the buffers and calls each
        # fused loop and opaque op in turn) is generated as C++, not Python. A batch-1 decode step
        # calls ~10 of them per layer; in Python each cost a few microseconds with the second
        # core idle (docs/cpu_kernels.md#the-compiled-graph).
        use_own_inductor_cache()
        # forward as a code object of this model's own: dynamo keeps graphs and guards per code
        # object, and every model of a class shares its forward's, so a process's 9th compiled
        # engine would hit dynamo's recompile limit (a failure under fullgraph) after checking
        # every earlier model's guards.
        shared = type(model).forward
        self._code = shared.__code__.replace()
        # The copy's compiled graph and tracing state would outlive this engine (compile_release.py).
        weakref.finalize(self, release_compiled_code, self._code).atexit = False
        own = types.FunctionType(self._code, shared.__globals__, shared.__name__,
                                 shared.__defaults__, shared.__closure__)
        own.__kwdefaults__ = shared.__kwdefaults__
        self._cpp_wrapper = device.type == "cpu"
        # realize_opcount_threshold: a value that several loops read (the residual stream, the
        # embedding's rows, rope's cos and sin) is computed once into a buffer when its
        # expression has over 4 ops; inductor's CPU default (50) had the first layers' loops
        # each redo the embedding lookup and the residual adds, and every layer's loop redo
        # cos and sin per element (docs/step_cost.md, sixth change).
        options: dict[str, object] = {"size_asserts": False, "alignment_asserts": False,
                                      "cpp_wrapper": self._cpp_wrapper, "realize_opcount_threshold": 4}
        # A tiny model's fused loops on one thread: no parallel region per loop (loop_threads.py).
        self.loop_threads = loop_threads(model) if device.type == "cpu" else None
        if self.loop_threads is not None:
            options["cpp.threads"] = self.loop_threads
        self._forward: Callable[..., torch.Tensor] = torch.compile(
            types.MethodType(own, model), fullgraph=True, dynamic=False, options=options)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # Once warm, the one graph serves every step: dynamo's guards would only confirm it. Even
        # the "differentiating" guards that skip_guard_eval_unsafe keeps check every weight
        # tensor the graph reads, each reached through the module tree, a visible share of a
        # batch-1 decode step (docs/cpu_kernels.md#the-compiled-graph), and so does the bytecode
        # dynamo made of forward, which passes them to the graph. So the warm forward calls the
        # graph itself on the tensors it reads (graph_call.py); tests/runner/test_compile.py
        # holds it to eager and checks nothing recompiles.
        if self._call is not None:
            return self._call(input_ids, positions)
        # Every step's tensors are new objects: the mark must be on each (a flag on the tensor).
        _mark_tokens_unbacked(input_ids, positions)
        if not self._warm:
            return self._forward(input_ids, positions)
        # Warm, but no GraphCall (dynamo made more than one graph while warming up, or its
        # bytecode does more than call the graph): only the guards that tell graphs apart.
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            return self._forward(input_ids, positions)

    @torch.inference_mode()
    def warmup(self, num_tokens: int, device: torch.device) -> float:
        """Compile with a ``num_tokens`` batch and run it once more at one token (the decode
        shape, which must hit the same graph); returns the seconds spent."""
        start = time.perf_counter()
        forward = type(self.model).forward
        made: list[types.CodeType] = []  # the bytecode dynamo makes of forward while warming up

        def keep(code: types.CodeType, new_code: types.CodeType) -> None:
            if code is self._code:
                made.append(new_code)

        hook = torch._dynamo.convert_frame.register_bytecode_hook(keep)
        try:
            for n in (max(num_tokens, 2), 1):
                ids = torch.zeros(n, dtype=torch.long, device=device)
                self(ids, torch.arange(n, device=device))
        finally:
            hook.remove()
        self._warm = True
        if len(made) == 1:  # one graph for both token counts, as the mark promises
            # forward's globals: where dynamo put the compiled graph that the bytecode calls.
            self._call = GraphCall.capture(made[0], forward.__globals__, self.model, device,
                                           tensor_counts=self._cpp_wrapper)
        if self._call is None:
            logger.info("torch.compile: the warm forward goes through dynamo (%s)",
                        "several graphs" if len(made) != 1 else
                        "the bytecode does more than call the graph on tensors the model holds")
        self.compile_seconds = time.perf_counter() - start
        return self.compile_seconds


def maybe_compile(model: torch.nn.Module, enforce_eager: bool | None, device: torch.device,
                  warmup_tokens: int) -> CompiledForward | None:
    """The compiled forward, warmed up, or None (eager) after one log line saying why."""
    reason = compile_disabled_reason(enforce_eager, device)
    if reason is not None:
        logger.info("torch.compile off: %s; the model runs eagerly", reason)
        return None
    compiled = CompiledForward(model, device)
    seconds = compiled.warmup(warmup_tokens, device)
    logger.info("torch.compile: compiled the model forward in %.1f s (token count dynamic%s)",
                seconds, "" if compiled.loop_threads is None else f"; fused loops on {compiled.loop_threads} thread")
    return compiled
