"""The linears' kernels side by side: pagedllm's skinny kernel (what a packed layer runs), in
the engine's native build and, with ``--isa v3 v4``, built for x86-64-v3 (AVX2) or -v4
(AVX-512) beside it, against oneDNN's prepacked matmul (what vLLM's CPU path uses) and a plain
``F.linear`` (MKL sgemm), on the benchmark model's shapes, at decode and prefill row counts,
calls interleaved. ``--formats`` adds the kernel over weights held in other formats
(layers/quantization/: bf16, fp16 panels; q8_0, q4_0 quantized at load; q5_0 and q6_k, GGUF
Q5_0's and Q6_K's blocks in the q5 and q6 panels), each timed against the float32 panels' kernel too; their GB/s count
the bytes the format holds. ``--int8`` adds the block formats with int8-quantized activations
(csrc/int8_gemm.h), each timed against the same weight's exact (float32-activation) path too;
``--bf16-activations`` (or ``--amx``) adds bf16 with bf16 activations (csrc/bf16_gemm.h: AMX tiles,
or AVX512-BF16 dot products on CPUs without AMX), against its exact path and oneDNN's bf16
``F.linear`` (vLLM's bf16 matmul on such CPUs).

Before every timed call the caches are flushed (a pass over a buffer larger than the last-level
cache), as in the engine, where a step reads ~170 MB of weights and KV and nothing stays cached
between one layer's call and the next step's. Prints the median time per call, the weights' read
rate (what bounds a decode step's linears), each kernel's GFLOP/s (what bounds a prefill's) and
the faster library's time over each skinny build's (> 1: the kernel is faster).

    python -m benchmarks.linear_kernels [--rows 1 8 16 32 64 256 2048] [--rounds 7] [--isa native v3 v4]
        [--formats bf16 fp16 q8_0 q4_0 q5_0 q6_k] [--int8] [--bf16-activations] [--shapes 4864x896 896x4864]
        [--threads N] [--cpu-time]
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from benchmarks.common import MODEL_CONFIGS, log


def layer_shapes(model_config: str) -> dict[str, tuple[int, int]]:
    """The model's linear layers: name -> (out_features, in_features)."""
    spec = MODEL_CONFIGS[model_config]
    hidden, inter = spec["hidden_size"], spec["intermediate_size"]
    q = spec["num_attention_heads"] * spec["head_dim"]
    kv = spec["num_key_value_heads"] * spec["head_dim"]
    return {"qkv_proj": (q + 2 * kv, hidden), "o_proj": (hidden, q), "gate_up_proj": (2 * inter, hidden),
            "down_proj": (hidden, inter), "lm_head": (spec["vocab_size"], hidden)}


def linear_candidates(n: int, k: int, isas: list[str], seed: int = 0) -> dict[str, Callable]:
    """name -> x -> x W^T for one random [n, k] weight: "skinny <isa>" for each build this CPU
    can run, "onednn" (prepacked) and "f_linear"."""
    import torch
    import torch.nn.functional as F

    from pagedllm.kernels.cpu_extension import can_run, load_cpu_ops
    from pagedllm.layers.linear import pack_weight

    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    panels = pack_weight(w, None)
    out: dict[str, Callable] = {}
    for isa in isas:
        ops = load_cpu_ops(isa) if can_run(isa) else None
        if ops is not None and panels is not None:
            out[f"skinny {isa}"] = lambda x, op=ops.skinny_gemm: op(x, panels, n)
    onednn = torch.ops.mkldnn._reorder_linear_weight(w, None)
    out["onednn"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], "")
    out["f_linear"] = lambda x: F.linear(x, w)
    return out


def format_candidates(n: int, k: int, formats: list[str], isas: list[str], seed: int = 0,
                      int8: bool = False, amx: bool = False) -> tuple[dict[str, Callable], dict[str, int]]:
    """name -> x -> x W^T for one random [n, k] weight held in each of ``formats`` ("bf16",
    "fp16", "q8_0", "q4_0", "q5_0", "q6_k"), per build in ``isas`` ("q8_0 int8 v3": with int8 activations,
    when ``int8``; "bf16 bf16x native": bf16 activations, on AMX tiles or AVX512-BF16 dot
    products, and "onednn bf16", torch's bf16 F.linear, when ``amx``); and name -> the bytes
    each reads."""
    import torch
    import torch.nn.functional as F

    from pagedllm.kernels.cpu_extension import can_run, has_bf16_activations, load_cpu_ops
    from pagedllm.layers.quantization import QuantizedWeight, quantize_linear

    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    out: dict[str, Callable] = {}
    nbytes: dict[str, int] = {}
    for fmt in formats:
        if fmt in ("bf16", "fp16"):
            qw = QuantizedWeight.from_half(w.to(torch.bfloat16 if fmt == "bf16" else torch.float16))
        elif fmt == "q5_0":
            qw = _q5_0(w)
        elif fmt == "q6_k":
            qw = _q6_k(w)
        else:
            qw = quantize_linear(w, fmt)
        for isa in isas:
            ops = load_cpu_ops(isa) if can_run(isa) else None
            if ops is not None:
                name = f"{fmt} {isa}"
                for act in (False, True) if int8 and fmt.startswith("q") else (False,):
                    name = f"{fmt} int8 {isa}" if act else f"{fmt} {isa}"
                    out[name] = lambda x, op=ops.quant_linear, qw=qw, act=act: op(
                        x, qw.codes, qw.scales, qw.offsets, qw.group_size, n, None, act)
                    nbytes[name] = qw.nbytes
                if amx and fmt == "bf16" and has_bf16_activations(isa):
                    vnni = qw.to_vnni()
                    out[f"bf16 bf16x {isa}"] = lambda x, op=ops.quant_linear, vnni=vnni: op(
                        x, vnni.codes, None, None, 0, n, None, True)
                    nbytes[f"bf16 bf16x {isa}"] = vnni.nbytes
        if amx and fmt == "bf16":
            wb = w.bfloat16()
            out["onednn bf16"] = lambda x, wb=wb: F.linear(x.bfloat16(), wb)
            nbytes["onednn bf16"] = 2 * n * k
    return out, nbytes


def _q5_0(w):
    """``w`` as GGUF Q5_0 blocks would hold it (a scale per 32, codes -16..15; not load-time
    quantization, which offers q8_0/q4_0: the kernel's speed does not depend on the values)."""
    import torch

    from pagedllm.layers.quantization import QuantizedWeight

    groups = w.view(w.shape[0], -1, 32)
    scales = groups.abs().amax(-1) / 16
    codes = (groups / scales.clamp_min(1e-30)[..., None]).round().clamp(-16, 15).view_as(w)
    return QuantizedWeight.from_q5(codes.to(torch.int8), scales, None, 32)


def _q6_k(w):
    """``w`` as GGUF Q6_K super-blocks would hold it (codes -32..31 per group of 16, an int8
    sub-scale per group and an fp16 d per 256: held as q6 with super-block records)."""
    import torch

    from pagedllm.layers.quantization import QuantizedWeight
    from pagedllm.layers.quantization.quantized_weight import GroupScales

    if w.shape[1] % 256:
        raise SystemExit(f"q6_k takes rows of whole 256-element super-blocks, not {w.shape[1]}")
    groups = w.view(w.shape[0], -1, 16)
    scales = groups.abs().amax(-1) / 32  # [n, k / 16]
    d = (scales.view(w.shape[0], -1, 16).amax(-1) / 127).half()  # [n, k / 256]
    sub = (scales / d.float().repeat_interleave(16, dim=1).clamp_min(1e-30)).round().clamp(1, 127)
    exact = d.float().repeat_interleave(16, dim=1) * sub
    codes = (groups / exact.clamp_min(1e-30)[..., None]).round().clamp(-32, 31).view_as(w)
    return QuantizedWeight.from_q6(codes.to(torch.int8),
                                   GroupScales(d.numpy(), sub.to(torch.int8).numpy()), None, 16)


def time_interleaved(kernels: dict[str, Callable], x, rounds: int, flush,
                     clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median seconds per call of each kernel on ``x``, caches flushed before every call, the
    order reversed every other round; ``clock``: wall time, or the thread's CPU time (on a
    shared machine, with one thread)."""
    times: dict[str, list[float]] = {key: [] for key in kernels}
    for r in range(rounds + 1):  # round 0 warms up
        for key in (list(kernels) if r % 2 == 0 else list(reversed(kernels))):
            flush.sum()
            t0 = clock()
            kernels[key](x)
            if r:
                times[key].append(clock() - t0)
    return {key: statistics.median(v) for key, v in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 256, 2048])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--model-config", default="qwen3-58m", choices=sorted(MODEL_CONFIGS))
    parser.add_argument("--isa", nargs="+", default=["native"], choices=["native", "v3", "v4"],
                        help="builds of the skinny kernel to measure (those this CPU can run)")
    parser.add_argument("--formats", nargs="*", default=[],
                        choices=["bf16", "fp16", "q8_0", "q4_0", "q5_0", "q6_k"],
                        help="weight formats to time beside float32 (layers/quantization/)")
    parser.add_argument("--int8", action="store_true",
                        help="time the block formats with int8 activations too (against their "
                             "exact path)")
    parser.add_argument("--bf16-activations", "--amx", dest="amx", action="store_true",
                        help="time bf16 with bf16 activations too, on AMX tiles or AVX512-BF16 "
                             "dot products (needs --formats bf16; against its exact path and "
                             "oneDNN's bf16 F.linear)")
    parser.add_argument("--shapes", nargs="*", default=[],
                        help="OUTxIN layer shapes in place of the model config's")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time the calling thread's CPU time, not wall time (with --threads 1 "
                             "on a machine others share: their load then does not count)")
    args = parser.parse_args(argv)

    import torch

    from pagedllm.kernels.cpu_extension import cpu_description, load_cpu_ops

    if load_cpu_ops() is None:
        raise SystemExit("the C++ CPU kernels cannot be built here (no compiler?)")
    torch.set_grad_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    flush = torch.ones(64 << 20)  # 256 MiB, more than the last-level cache
    log(f"{cpu_description()}; {torch.get_num_threads()} threads; times are medians of "
        f"{args.rounds} cold calls; ratios: the faster library's time over the kernel's")
    shapes = ({shape: tuple(int(d) for d in shape.split("x")) for shape in args.shapes}
              or layer_shapes(args.model_config))
    for name, (n, k) in shapes.items():
        kernels = linear_candidates(n, k, args.isa)
        mine = [key for key in kernels if key.startswith("skinny")]
        formats, nbytes = format_candidates(n, k, args.formats, args.isa, int8=args.int8,
                                            amx=args.amx)
        kernels.update(formats)
        gen = torch.Generator().manual_seed(1)
        for rows in args.rows:
            med = time_interleaved(kernels, torch.randn(rows, k, generator=gen), args.rounds, flush,
                                   time.thread_time if args.cpu_time else time.perf_counter)
            best_lib = min(med["onednn"], med["f_linear"])
            cells = [f"{key} {med[key] * 1e6:7.0f} us "
                     f"{nbytes.get(key, 4 * n * k) / med[key] / 1e9:5.1f} GB/s "
                     f"{2 * rows * n * k / med[key] / 1e9:5.0f} GF/s" for key in kernels]
            ratios = " ".join(f"{key}: {best_lib / med[key]:.2f}x" for key in mine)
            # each format against the float32 panels of its own build
            ratios += "".join(f" {key} vs f32: {med['skinny ' + key.split()[-1]] / med[key]:.2f}x"
                              for key in formats if "skinny " + key.split()[-1] in med)
            # int8 activations against the same weight's exact path
            ratios += "".join(f" {key} vs exact: {med[key.replace(' int8', '')] / med[key]:.2f}x"
                              for key in formats if " int8 " in key)
            # bf16 activations against the same weight's exact path and oneDNN's bf16
            ratios += "".join(f" {key} vs exact: {med[key.replace(' bf16x', '')] / med[key]:.2f}x"
                              f" vs onednn bf16: {med['onednn bf16'] / med[key]:.2f}x"
                              for key in formats if " bf16x " in key)
            print(f"{name:12s} {rows:4d} | " + " | ".join(cells) + f" | {ratios}", flush=True)


if __name__ == "__main__":
    main()
