"""Half-precision weights against float32 at batch 1: the same checkpoint loaded once per
``--dtype`` (float32 first, the reference), one request decoding in interleaved rounds.

A CPU decode step of one sequence reads every weight once, so bf16/fp16 weights (half the bytes,
widened to float32 in registers: csrc/quant_gemm.cpp) should approach 2x float32. The model is
random, in the shape of Qwen2.5-0.5B or Llama-3.2-1B (benchmarks/gguf.py's shapes; Llama
architecture, the 32K synthetic tokenizer), saved once by transformers as float32 safetensors;
each engine converts it to its dtype at load. The job is benchmarks/gguf.py's decode: a 32-token
prompt, 128 new tokens, greedy; tok/s of the 127 steps after the first token. Prints each dtype's
median, its ratio to the first dtype's, and the share of the measured memory read bandwidth its
weight bytes per token are; and how many leading greedy ids each dtype shares with the first
(half precision is an approximation: they part where two tokens' logits are close).

    python -m benchmarks.half_decode [--shape qwen2.5-0.5b llama-3.2-1b]
                                     [--dtype float32 bfloat16 float16] [--rounds 3]
                                     [--threads N] [--model-dir DIR] [--engine-arg K=V]
                                     [--json FILE]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import CACHE_DIR, build_random_model, engine_args, log, write_json
from benchmarks.gguf import SHAPES, read_bandwidth

PROMPT_LEN, MAX_TOKENS = 32, 128


def weight_bytes_per_token(folder: Path, dtype: str) -> int:
    """Bytes of the weights a decode step reads in ``dtype``: every tensor of the checkpoint but
    an untied input embedding's table, of which a token reads one row (a table tied to the head
    is read whole), and of a MoE layer's experts the share one token's top-k reads. The norms'
    few floats are counted at the dtype's size too."""
    import json

    from safetensors import safe_open

    size = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    config = json.loads((folder / "config.json").read_text())
    tied = config.get("tie_word_embeddings", False)
    share = config.get("num_experts_per_tok", 1) / config.get("num_experts", 1)
    total = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                if name.endswith("embed_tokens.weight") and not tied:
                    continue
                numel = 1
                for d in f.get_slice(name).get_shape():
                    numel *= d
                total += numel * size * (share if ".mlp.experts." in name else 1)
    return int(total)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", nargs="+", default=["qwen2.5-0.5b"], choices=sorted(SHAPES))
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"],
                   choices=["float32", "bfloat16", "float16"],
                   help="one engine per dtype; ratios are to the first")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--model-dir", help="where to build the models (default: ~/.cache/pagedllm)")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="an extra engine argument for every dtype, e.g. enforce_eager=True")
    p.add_argument("--json", metavar="FILE")
    p.set_defaults(device="cpu")  # engine_args reads it
    args = p.parse_args(argv)

    import random

    import torch

    from pagedllm import LLM, SamplingParams
    from pagedllm.kernels.cpu_extension import cpu_description

    torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth()
    log(f"CPU: {cpu_description()}; memory read bandwidth {bandwidth / 1e9:.1f} GB/s")
    rng = random.Random(0)
    prompt = [rng.randrange(3, 32000) for _ in range(PROMPT_LEN)]
    results = []
    for shape in args.shape:
        spec = SHAPES[shape]
        folder = build_random_model(spec.get("kind", "Llama"),
                                    {k: v for k, v in spec.items() if k != "kind"},
                                    Path(args.model_dir or CACHE_DIR) / f"half-{shape}", stamp=spec)
        engines = {dtype: LLM(str(folder), **engine_args(
                       args, dtype=dtype, max_model_len=512,
                       kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False))
                   for dtype in args.dtype}
        rates: dict[str, list[float]] = {d: [] for d in engines}
        ids: dict[str, list[int]] = {}
        for r in range(args.rounds + 1):  # round 0 warms up
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            for dtype in order:
                llm = engines[dtype]

                def run(n: int) -> list[int]:
                    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
                    return list(out[0].outputs[0].token_ids)

                start = time.perf_counter()
                run(1)
                prefill_s = time.perf_counter() - start
                start = time.perf_counter()
                ids[dtype] = run(MAX_TOKENS)
                # The same prefill again, then the steps: the difference is the steps alone.
                decode_s = time.perf_counter() - start - prefill_s
                if r:
                    rates[dtype].append((MAX_TOKENS - 1) / decode_s)
            if r:
                log(f"  round {r}: " + ", ".join(f"{d} {rates[d][-1]:.1f} tok/s" for d in engines))
        first = args.dtype[0]
        medians = {d: statistics.median(v) for d, v in rates.items()}
        nbytes = {d: weight_bytes_per_token(folder, d) for d in engines}
        result = {
            "shape": shape, "threads": args.threads, "read_bandwidth": bandwidth,
            "decode_tok_s": medians, "rounds": rates, "weight_bytes_per_token": nbytes,
            "ratio_vs_first": {d: medians[d] / medians[first] for d in engines},
            "bandwidth_share": {d: medians[d] * nbytes[d] / bandwidth for d in engines},
            "same_leading_ids": {d: next((i for i, (a, b) in enumerate(zip(ids[d], ids[first]))
                                          if a != b), len(ids[d])) for d in engines}}
        results.append(result)
        print(f"half_decode {shape}: " + "; ".join(
            f"{d} {medians[d]:.1f} tok/s ({result['ratio_vs_first'][d]:.2f}x, "
            f"{nbytes[d] / 1e6:.0f} MB/token, {100 * result['bandwidth_share'][d]:.0f}% of "
            f"bandwidth, {result['same_leading_ids'][d]}/{MAX_TOKENS} ids as {first})"
            for d in engines), flush=True)
        del engines
    write_json(args.json, {"cpu": cpu_description(), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
