"""Decode attention against the memory-bandwidth limit.

One decode step of one attention layer: every request attends its single new query (all query
heads) to its whole cached context. Decode attention reads each request's K and V once, so its
speed limit is memory bandwidth; this script prints the K/V bytes read per second by each
backend next to the bandwidth of a large tensor copy measured in the same run (read + write
bytes per second, as STREAM's "copy" counts them), and the ratio. Rounds are interleaved across
candidates and medians reported, so a VM's drifting speed affects all alike.

Candidates: ``cpu_paged`` (the C++ kernel, reads the paged cache in place; ``--isa v3 v4``
adds the kernel built for x86-64-v3 (AVX2) or -v4 (AVX-512) beside the engine's native build,
so an AVX-512 machine measures the AVX2 variant too), ``torch`` (gathers the blocks, then one
SDPA), and ``dense`` (SDPA over a contiguous [B, Hkv, L, D] copy of the context: what the
deleted decode store did, without the cost of keeping the copy).

    python benchmarks/decode_attention.py [--requests 64] [--context 1024] [--heads 32]
        [--kv-heads 8] [--head-dim 128] [--block-size 16] [--dtype float32] [--rounds 5]
        [--isa native v3 v4] [--kv-cache-dtype auto|bfloat16|float16|fp8|fp8_e4m3|fp8_e5m2]

``--kv-cache-dtype`` stores the paged cache narrower than the query (the engine's flag); the
dense candidate keeps ``--dtype``. GB/s of K/V count the bytes the cache holds.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.nn.functional as F

from pagedllm.config import KV_CACHE_DTYPES
from pagedllm.kernels.cpu_extension import can_run, cpu_description, load_cpu_ops
from pagedllm.layers import (
    Attention,
    bind_kv_caches,
    build_attention_metadata,
    get_attn_backend,
    kv_cache_shape,
    set_forward_context,
)
from pagedllm.layers.attention.kv_cache_dtype import resolve_kv_cache_dtype, to_cache_dtype


def _time(fn, iters: int) -> float:
    """Seconds per call, best of nothing: the mean of ``iters`` calls after one warm-up."""
    fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=5, help="calls per candidate per round")
    p.add_argument("--copy-mib", type=int, default=256, help="least size of the copied tensor")
    p.add_argument("--isa", nargs="+", default=["native"], choices=["native", "v3", "v4"],
                   help="builds of the kernel to measure (those this CPU can run)")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    B, L, H, Hkv, D, bs = (args.requests, args.context, args.heads, args.kv_heads,
                           args.head_dim, args.block_size)
    torch.manual_seed(0)

    # A paged cache with shuffled (non-contiguous) blocks, every request at position L - 1.
    blocks_per_req = -(-L // bs)
    num_blocks = B * blocks_per_req + 1
    cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype)
    cache = to_cache_dtype(torch.randn(kv_cache_shape(num_blocks, bs, Hkv, D)), cache_dtype)
    ids = list(range(1, num_blocks))
    random.Random(0).shuffle(ids)
    tables = [ids[i * blocks_per_req:(i + 1) * blocks_per_req] for i in range(B)]
    layer = Attention(H, Hkv, D, scale=D ** -0.5, layer_idx=0)
    bind_kv_caches(torch.nn.ModuleList([layer]), [cache])
    q = torch.randn(B, H, D).to(dtype)
    k = torch.randn(B, Hkv, D).to(dtype)
    v = torch.randn(B, Hkv, D).to(dtype)

    def paged(name: str):
        md = build_attention_metadata([1] * B, [L - 1] * B, tables, bs, "cpu",
                                      backend=get_attn_backend(name, "cpu"))

        def run() -> None:
            with torch.inference_mode(), set_forward_context(md):
                layer(q, k, v)
        return run

    dense_k = torch.randn(B, Hkv, L, D).to(dtype)
    dense_v = torch.randn(B, Hkv, L, D).to(dtype)
    mask = torch.zeros(B, 1, 1, L, dtype=dtype)  # the store's additive mask (all visible here)

    def dense() -> None:
        with torch.inference_mode():
            F.scaled_dot_product_attention(q.view(B, Hkv, H // Hkv, D), dense_k, dense_v,
                                           attn_mask=mask, scale=D ** -0.5)

    kv_bytes = 2 * B * L * Hkv * D * cache.element_size()
    src = torch.randn(max(kv_bytes, args.copy_mib << 20) // 4)  # far beyond any CPU cache
    dst = torch.empty_like(src)
    candidates = {}
    for isa in args.isa:
        ops = load_cpu_ops(isa) if can_run(isa) else None
        if ops is None:
            print(f"  (no cpu_paged {isa}: this CPU cannot run it, or it did not build)")
        elif isa == "native":
            candidates["cpu_paged"] = paged("cpu_paged")
        else:
            md = build_attention_metadata([1] * B, [L - 1] * B, tables, bs, "cpu",
                                          backend=get_attn_backend("cpu_paged", "cpu"))
            candidates[f"cpu_paged {isa}"] = (
                lambda op=ops.paged_attention, md=md: op(q, cache, md.block_tables,
                                                         md.query_start_loc_tensor,
                                                         md.seq_lens_tensor, D ** -0.5))
    candidates.update({"torch": paged("torch"), "dense": dense, "copy": lambda: dst.copy_(src)})
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(args.rounds):
        for name, fn in candidates.items():
            times[name].append(_time(fn, args.iters))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    bandwidth = 2 * src.numel() * src.element_size() / med["copy"]
    print(f"decode attention: {B} requests x {L} context, {H} heads / {Hkv} kv heads x {D}, "
          f"block_size {bs}, {args.dtype}, KV {str(cache_dtype).removeprefix('torch.')}, "
          f"{torch.get_num_threads()} threads; "
          f"{kv_bytes / 2**20:.0f} MiB of K/V per call; medians of {args.rounds} interleaved rounds; "
          f"{cpu_description()}")
    print(f"  memory bandwidth (tensor copy, read + write): {bandwidth / 1e9:.1f} GB/s")
    for name in candidates:
        if name == "copy":
            continue
        rate = kv_bytes / med[name]
        print(f"  {name:>13}: {med[name] * 1e3:7.2f} ms  {rate / 1e9:6.1f} GB/s of K/V  "
              f"{rate / bandwidth:6.1%} of bandwidth")


if __name__ == "__main__":
    main()
