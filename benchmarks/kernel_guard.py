"""CI's guard on the C++ kernels' speed: every build this CPU can run (x86-64-v3, -v4) of the
linear kernel against oneDNN's prepacked matmul and ``F.linear`` on the 58M benchmark model's
shapes at 1, 8, 32 and 256 rows, and of the attention kernel against the torch backend on
decode batches (caches flushed, calls interleaved, medians). Fails (exit 1) when a kernel takes
more than twice the time of the faster library path anywhere: a margin far outside this
machine's noise, so it trips only on a kernel that is wrong for the CPU (as the AVX-512 tiles
were on AVX2: 0.04-0.3x), not on a slow day. Prints its table into the CI log.

Each level is measured in a process of its own against the libraries capped to that level
(``LIBRARY_CAPS``): the AVX2 build on an AVX-512 CPU stands in for an AVX2 machine, so it
is compared with oneDNN's and MKL's AVX2 code, as it would be there. Uncapped, the libraries'
AVX-512 code is twice as wide, and the v3 build met 0.47x at 256 rows of the head on a Sapphire
Rapids-class VM, though it is 0.9-1.0x of the libraries on an AVX2 CPU.

    python -m benchmarks.kernel_guard [--rounds 5] [--min-ratio 0.5] [--level v3|v4]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

from benchmarks.common import REPO_ROOT, log
from benchmarks.linear_kernels import layer_shapes, linear_candidates, time_interleaved

# The environment that keeps oneDNN and MKL (read when they start) to a level's instructions.
LIBRARY_CAPS = {"v3": {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
                "v4": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "MKL_ENABLE_INSTRUCTIONS": "AVX512"}}

ROWS = (1, 8, 32, 256)
# Decode attention: (requests, context, heads, kv heads, head_dim): the 58M model's heads at
# workload cpu's mean batch, and a larger model's at 1,024 tokens.
ATTENTION_SHAPES = ((32, 300, 8, 4, 64), (16, 1024, 32, 8, 128))


def attention_candidates(shape: tuple[int, ...], isas: list[str]) -> dict:
    """name -> () -> one decode step of one layer: "paged <isa>" per build, "torch" (the
    reference backend: gathers the blocks, then SDPA)."""
    import random

    import torch

    from pagedllm.kernels.cpu_extension import load_cpu_ops
    from pagedllm.layers import (
        Attention,
        bind_kv_caches,
        build_attention_metadata,
        get_attn_backend,
        kv_cache_shape,
        set_forward_context,
    )

    B, L, H, Hkv, D = shape
    bs = 16
    per_req = -(-L // bs)
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(kv_cache_shape(B * per_req + 1, bs, Hkv, D), generator=gen)
    ids = list(range(1, B * per_req + 1))
    random.Random(0).shuffle(ids)
    tables = [ids[i * per_req:(i + 1) * per_req] for i in range(B)]
    layer = Attention(H, Hkv, D, scale=D ** -0.5, layer_idx=0)
    bind_kv_caches(torch.nn.ModuleList([layer]), [cache])
    q = torch.randn(B, H, D, generator=gen)
    kv = torch.randn(B, Hkv, D, generator=gen)
    md = build_attention_metadata([1] * B, [L - 1] * B, tables, bs, "cpu",
                                  backend=get_attn_backend("torch", "cpu"))

    def torch_step() -> None:
        with torch.inference_mode(), set_forward_context(md):
            layer(q, kv, kv)

    out = {}
    for isa in isas:
        op = load_cpu_ops(isa).paged_attention
        out[f"paged {isa}"] = (lambda op=op: op(q, cache, md.block_tables, md.query_start_loc_tensor,
                                                md.seq_lens_tensor, D ** -0.5))
    out["torch"] = torch_step
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-ratio", type=float, default=0.5,
                        help="fail below this ratio of the faster library path's time to the kernel's")
    parser.add_argument("--level", choices=sorted(LIBRARY_CAPS),
                        help="measure this level only, in this process (default: each level this "
                             "CPU runs, each in a process whose libraries are capped to it)")
    args = parser.parse_args(argv)
    if args.level is None:
        from pagedllm.kernels.cpu_extension import can_run, cpu_description

        isas = [isa for isa in ("v3", "v4") if can_run(isa)]
        if not isas:
            log(f"kernel guard: {cpu_description()} runs no tuned level; the engine uses torch's "
                "ops here")
            return 0
        failed = [isa for isa in isas if subprocess.run(
            [sys.executable, "-m", "benchmarks.kernel_guard", "--level", isa, "--rounds",
             str(args.rounds), "--min-ratio", str(args.min_ratio)],
            env={**os.environ, **LIBRARY_CAPS[isa]}, cwd=REPO_ROOT).returncode]
        log("kernel guard: " + (f"FAILED at {', '.join(failed)}" if failed else "passed"))
        return 1 if failed else 0

    import torch

    from pagedllm.kernels.cpu_extension import cpu_description, load_cpu_ops

    torch.set_grad_enabled(False)
    isas = [args.level]
    missing = [isa for isa in isas if load_cpu_ops(isa) is None]
    if missing:
        log(f"kernel guard: FAILED: the {', '.join(missing)} build of the kernels did not build")
        return 1
    flush = torch.ones(64 << 20)  # 256 MiB, more than the last-level cache
    caps = ", ".join(f"{k}={v}" for k, v in LIBRARY_CAPS[args.level].items())
    log(f"kernel guard on {cpu_description()}, {torch.get_num_threads()} threads, level "
        f"{args.level} against the libraries capped to it ({caps}); medians of {args.rounds} "
        f"interleaved rounds, caches flushed; ratio = the faster library's time / the kernel's; "
        f"fails below {args.min_ratio}")
    failures = []
    for name, (n, k) in layer_shapes("qwen3-58m").items():
        kernels = linear_candidates(n, k, isas)
        gen = torch.Generator().manual_seed(1)
        for rows in ROWS:
            med = time_interleaved(kernels, torch.randn(rows, k, generator=gen), args.rounds, flush)
            lib = min(med["onednn"], med["f_linear"])
            cells = []
            for isa in isas:
                ratio = lib / med[f"skinny {isa}"]
                cells.append(f"{isa} {med[f'skinny {isa}'] * 1e6:8.0f} us {ratio:5.2f}x")
                if ratio < args.min_ratio:
                    failures.append(f"linear {isa} {name} {rows} rows: {ratio:.2f}x")
            print(f"  linear {name:12s} {rows:4d} rows | " + " | ".join(cells) +
                  f" | oneDNN {med['onednn'] * 1e6:8.0f} us | F.linear {med['f_linear'] * 1e6:8.0f} us",
                  flush=True)
    for shape in ATTENTION_SHAPES:
        kernels = attention_candidates(shape, isas)
        wrapped = {key: (lambda _x, fn=fn: fn()) for key, fn in kernels.items()}
        med = time_interleaved(wrapped, None, args.rounds, flush)
        cells = []
        for isa in isas:
            ratio = med["torch"] / med[f"paged {isa}"]
            cells.append(f"{isa} {med[f'paged {isa}'] * 1e3:7.2f} ms {ratio:5.2f}x")
            if ratio < args.min_ratio:
                failures.append(f"attention {isa} {shape}: {ratio:.2f}x")
        B, L, H, Hkv, D = shape
        print(f"  attention {B} x {L}, {H}/{Hkv} heads x {D} | " + " | ".join(cells) +
              f" | torch backend {med['torch'] * 1e3:7.2f} ms", flush=True)
    if failures:
        log(f"kernel guard {args.level}: FAILED: " + "; ".join(failures))
        return 1
    log(f"kernel guard {args.level}: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
