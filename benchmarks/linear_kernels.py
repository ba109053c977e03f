"""The linears' kernels side by side: pagedllm's skinny kernel (what a prepacked layer runs)
against oneDNN's prepacked matmul (what vLLM's CPU path and pagedllm before it used) and a plain
``F.linear`` (MKL sgemm), on the benchmark model's shapes, at decode and prefill row counts,
calls interleaved.

Before every timed call the caches are flushed (a pass over a buffer larger than the last-level
cache), as in the engine, where a step reads ~170 MB of weights and KV and nothing stays cached
between one layer's call and the next step's. Prints the median time per call, the weights' read
rate (what bounds a decode step's linears), the skinny kernel's GFLOP/s (what bounds a prefill's)
and the ratio of each peer's time to the skinny kernel's.

    python -m benchmarks.linear_kernels [--rows 1 8 16 32 64 256 2048] [--rounds 7]
"""
from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import MODEL_CONFIGS, log


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 256, 2048])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--model-config", default="qwen3-58m", choices=sorted(MODEL_CONFIGS))
    args = parser.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from pagedllm.layers.cpu_extension import load_cpu_ops
    from pagedllm.layers.linear import Linear, prepack_linear_weights

    if load_cpu_ops() is None:
        raise SystemExit("the C++ CPU kernels cannot be built here (no compiler?)")
    torch.set_grad_enabled(False)
    spec = MODEL_CONFIGS[args.model_config]
    hidden, inter = spec["hidden_size"], spec["intermediate_size"]
    q = spec["num_attention_heads"] * spec["head_dim"]
    kv = spec["num_key_value_heads"] * spec["head_dim"]
    shapes = {"qkv_proj": (q + 2 * kv, hidden), "o_proj": (hidden, q), "gate_up_proj": (2 * inter, hidden),
              "down_proj": (hidden, inter), "lm_head": (spec["vocab_size"], hidden)}
    flush = torch.ones(64 << 20)  # 256 MiB, more than the last-level cache
    log(f"{torch.get_num_threads()} threads; times are medians of {args.rounds} cold calls")
    print(f"{'layer':13s} {'rows':>4s} {'skinny':>29s} {'oneDNN prepacked':>26s} {'F.linear':>26s}")
    for name, (n, k) in shapes.items():
        gen = torch.Generator().manual_seed(0)
        layer = Linear(k, n, bias=False)
        layer.weight.data = w = torch.randn(n, k, generator=gen)
        prepack_linear_weights(layer)
        panels = layer.packed_weight
        onednn = torch.ops.mkldnn._reorder_linear_weight(w, None)
        kernels = {
            "skinny": lambda x: torch.ops.pagedllm.skinny_gemm(x, panels, n),
            "onednn": lambda x: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""),
            "f_linear": lambda x: F.linear(x, w),
        }
        for rows in args.rows:
            x = torch.randn(rows, k, generator=gen)
            times: dict[str, list[float]] = {key: [] for key in kernels}
            for r in range(args.rounds):
                order = list(kernels) if r % 2 == 0 else list(reversed(kernels))
                for key in order:
                    flush.sum()
                    t0 = time.perf_counter()
                    kernels[key](x)
                    times[key].append(time.perf_counter() - t0)
            med = {key: statistics.median(v) for key, v in times.items()}
            gbs = {key: 4 * n * k / t / 1e9 for key, t in med.items()}
            gflops = 2 * rows * n * k / med["skinny"] / 1e9
            print(f"{name:13s} {rows:4d} {med['skinny'] * 1e6:8.0f} us {gbs['skinny']:4.1f} GB/s {gflops:4.0f} GF/s"
                  f" {med['onednn'] * 1e6:8.0f} us {gbs['onednn']:4.1f} GB/s {med['onednn'] / med['skinny']:5.2f}x"
                  f" {med['f_linear'] * 1e6:8.0f} us {gbs['f_linear']:4.1f} GB/s {med['f_linear'] / med['skinny']:5.2f}x")


if __name__ == "__main__":
    main()
