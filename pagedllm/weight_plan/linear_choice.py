"""Which kernel multiplies each float32 linear layer on CPU: pagedllm's skinny kernel or torch's
matmul, measured on this CPU at startup (the safety net). bfloat16/float16 layers always take
the kernel over half panels (weight_plan/plan.py, ``hold_half_layers``).

The skinny kernel (kernels/csrc/skinny_gemm.cpp) is tuned per x86 level (AVX2, AVX-512); on a
CPU nobody tuned it for it is never used, and on a tuned one a surprise (another
microarchitecture, a VM's cache sizes) must not leave the engine at a fraction of torch's
speed. So the runner times both kernels on one layer of every distinct shape, at a decode and a
prefill row count, calls interleaved, and a shape leaves the kernel for torch's matmul (for
every row count: one choice per shape) only when torch's is clearly faster, by TORCH_MARGIN.
Near ties stay on the kernel: its sums do not depend on the row count, so a token gets the same
bits in a decode and in a prefill chunk (recomputed after a preemption), where MKL picks its
kernels by the row count; and a tie decided by a 2-core VM's noise would make two runs of the
same model differ. One log line says what was chosen and why. A chosen layer then holds its weight
as panels only (``Panels``), the others keep the plain matrix (``Dense``): one copy either way.

A shape is measured once per process (every engine a process builds then makes the same choice,
so two of them compute the same bits). ``PAGEDLLM_CPU_KERNELS=pagedllm`` or ``=torch`` skips
the measurement and takes that kernel for every layer it can (tests, and anyone comparing them).
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import envs
from pagedllm.kernels.cpu_extension import cpu_description, load_cpu_ops, native_isa
from pagedllm.layers.embed_head import ParallelLMHead
from pagedllm.layers.linear import Linear, pack_weight
from pagedllm.layers.weight_format import Panels

logger = logging.getLogger(__name__)

# Rows of the timed calls: a decode batch, and a prefill chunk (above the kernel's few-rows
# tile on every ISA, so both tiles are measured; small, so that the check of the 58M benchmark
# model takes ~0.5 s with the packing).
DECODE_ROWS, PREFILL_ROWS = 8, 72
_ROUNDS = 2
# torch's matmul replaces the kernel when the kernel takes this much longer (geometric mean over
# the two row counts): far above tiny layers' run-to-run noise, far below what a kernel wrong
# for the CPU loses (docs/cpu_kernels.md#elsewhere-in-the-engine).
TORCH_MARGIN = 1.25
_MEASURED: dict[tuple[int, int], float] = {}  # (out, in) -> speedup, this process's measurements


@dataclass(frozen=True)
class ShapeChoice:
    out_features: int
    in_features: int
    num_layers: int
    packed: bool      # True: the skinny kernel; False: torch's matmul
    speedup: float    # torch's time / the kernel's (geometric mean over the two row counts)

    def describe(self) -> str:
        measured = "not measured" if math.isnan(self.speedup) else f"{self.speedup:.2f}x"
        return f"{self.out_features}x{self.in_features}: {measured}"


@torch.inference_mode()
def choose_panels(model: nn.Module, take: Callable[[nn.Module, Panels], None]) -> list[ShapeChoice]:
    """Measure and choose per float32 layer shape of ``model`` (on CPU; step 4 of
    weight_plan/plan.py): each chosen layer and its panels go to ``take`` as they are packed
    (one float matrix beside its panels at a time), the others are left to ``Dense``. Returns
    the choice per shape."""
    layers = [m for m in model.modules() if isinstance(m, (Linear, ParallelLMHead))
              and m.weight is not None and m.weight_format is None]
    by_shape: dict[tuple[int, int], list[nn.Module]] = {}
    for layer in layers:
        if layer.weight.device.type == "cpu" and layer.weight.dtype == torch.float32:
            by_shape.setdefault(tuple(layer.weight.shape), []).append(layer)
    if not by_shape:
        return []
    if native_isa() is None or load_cpu_ops() is None:
        logger.info("linears: torch's matmul for every layer (no tuned kernel for this CPU)")
        return [ShapeChoice(n, k, len(group), False, 0.0) for (n, k), group in by_shape.items()]
    forced = envs.cpu_kernels()
    choices: list[ShapeChoice] = []
    for (n, k), group in by_shape.items():
        if forced == "auto" and (n, k) not in _MEASURED:
            _MEASURED[n, k] = _measure(group[0])
        speedup = _MEASURED.get((n, k), math.nan)
        packed = speedup * TORCH_MARGIN >= 1.0 if forced == "auto" else forced == "pagedllm"
        for i, layer in enumerate(group if packed else []):
            panels = Panels.pack(layer.weight)
            # Checked against float64 once per shape: the layout and the kernel's path depend
            # on the shape, not on the values.
            if panels is None or (i == 0 and not panels.check(getattr(layer, "bias", None))):
                packed = False
                break
            take(layer, panels)
        choices.append(ShapeChoice(n, k, len(group), packed, speedup))
    mine = [c for c in choices if c.packed]
    why = ("" if forced == "auto" else f" (PAGEDLLM_CPU_KERNELS={forced})")
    logger.info("linears on %s: the skinny kernel for %d of %d layer shapes, torch's matmul for "
                "the rest%s; torch's time over the kernel's at %d and %d rows: %s",
                cpu_description(), len(mine), len(choices), why, DECODE_ROWS, PREFILL_ROWS,
                ", ".join(c.describe() for c in choices))
    return choices


def _measure(layer: nn.Module) -> float:
    """torch's time over the skinny kernel's on ``layer``'s weight (geometric mean over the two
    row counts, best of _ROUNDS interleaved calls each); 0 when the kernel cannot take it."""
    weight, bias = layer.weight, getattr(layer, "bias", None)
    packed = pack_weight(weight, bias, check=False)  # checked when the layers are packed
    if packed is None:
        return 0.0
    ops = load_cpu_ops()
    n, k = weight.shape
    gen = torch.Generator().manual_seed(0)
    log_ratio = 0.0
    for rows in (DECODE_ROWS, PREFILL_ROWS):
        x = torch.randn(rows, k, generator=gen)
        kernels: list[Callable[[], object]] = [
            lambda: ops.packed_linear(x, packed, n, bias), lambda: F.linear(x, weight, bias)]
        mine, torch_time = best_times(kernels)
        log_ratio += math.log(torch_time / mine)
    return math.exp(log_ratio / 2)


def best_times(calls: list[Callable[[], object]], rounds: int = _ROUNDS) -> list[float]:
    """The best of ``rounds`` timed calls of each of ``calls``, interleaved (the order reversed
    every other round, so a drifting machine slows all alike), after one warm-up round (page
    faults, the thread pool)."""
    best = [math.inf] * len(calls)
    for r in range(rounds + 1):
        for i in (range(len(calls)) if r % 2 else reversed(range(len(calls)))):
            t0 = time.perf_counter()
            calls[i]()
            if r:
                best[i] = min(best[i], time.perf_counter() - t0)
    return best
