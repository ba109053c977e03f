"""One mixture-of-experts layer: pagedllm's FusedMoE (tokens grouped by expert, each active
expert once through the skinny kernel, layers/fused_moe.py) against a plain torch loop over
the experts with ``F.linear`` (transformers' eager experts), on the same router logits.

The shape is one layer of a small Qwen3-MoE: hidden 1024, 16 experts of intermediate 512, top-2
(25M expert parameters per layer; 18 such layers with attention and a 150k vocabulary make a
~0.65B model). Fixed seed; one warm-up; the median of interleaved timed calls; one line per row
count with the ratio (> 1: FusedMoE is faster).

    python -m benchmarks.moe_layer [--rows 1 8 64] [--rounds 9] [--threads N]
"""
from __future__ import annotations

import argparse
import statistics
import time

HIDDEN, NUM_EXPERTS, INTERMEDIATE, TOP_K = 1024, 16, 512, 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    import torch.nn.functional as F

    from pagedllm.kernels.cpu_extension import cpu_description
    from pagedllm.layers.fused_moe import FusedMoE
    from pagedllm.layers.moe_router import select_experts

    gen = torch.Generator().manual_seed(0)
    layer = FusedMoE(NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, "silu", renormalize=True)
    with torch.no_grad():
        layer.gate_up_proj.copy_(torch.randn(layer.gate_up_proj.shape, generator=gen) * 0.03)
        layer.down_proj.copy_(torch.randn(layer.down_proj.shape, generator=gen) * 0.03)
    w13, w2 = layer.gate_up_proj.detach().clone(), layer.down_proj.detach().clone()
    layer.process_weights_after_loading()
    kernel = ("skinny kernel" if "down_proj" in layer.expert_formats
              else "F.linear (no kernel here)")

    def torch_loop(x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(logits, TOP_K, renormalize=True)
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, choice = torch.where(ids == e)
            gate, up = F.linear(x[token], w13[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, w2[e]) * weights[token, choice, None]
            out.index_add_(0, token, y)
        return out

    print(f"MoE layer {HIDDEN}x{NUM_EXPERTS}x{INTERMEDIATE} top-{TOP_K} on {cpu_description()}, "
          f"{torch.get_num_threads()} threads; FusedMoE uses the {kernel}")
    for rows in args.rows:
        x = torch.randn(rows, HIDDEN, generator=gen)
        logits = torch.randn(rows, NUM_EXPERTS, generator=gen)
        calls = {"fused_moe": lambda: layer(x, logits), "torch_loop": lambda: torch_loop(x, logits)}
        times: dict[str, list[float]] = {name: [] for name in calls}
        with torch.inference_mode():
            diff = (calls["fused_moe"]() - calls["torch_loop"]()).abs().max().item()  # warm-up
            for r in range(args.rounds):
                for name in (list(calls) if r % 2 else reversed(list(calls))):
                    t0 = time.perf_counter()
                    calls[name]()
                    times[name].append(time.perf_counter() - t0)
        ours, peer = (statistics.median(times[n]) * 1e3 for n in ("fused_moe", "torch_loop"))
        print(f"rows {rows:4d}: fused_moe {ours:8.3f} ms  torch loop {peer:8.3f} ms  "
              f"ratio {peer / ours:5.2f}x  (max diff {diff:.1e})")


if __name__ == "__main__":
    main()
