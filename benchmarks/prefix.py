"""Prefix caching: many requests sharing one long system prompt, with the prefix cache on and off.

64 requests = one shared 1,024-token system prompt + a unique 32-token question each, 16 output
tokens (greedy, ignore_eos), all submitted at once (random token ids, random.Random(0)). Each
setting gets its own LLM, one warm-up call on unrelated prompts, then one timed generate().
Reported per setting: wall time, tokens/s (prompt + output) and ``pagedllm:prompt_tokens_computed``
(prompt tokens actually run through the model), and the ratios on/off.

    python -m benchmarks.prefix [--num-requests 64 --prefix-len 1024 --question-len 32]
"""
from __future__ import annotations

import argparse
import gc
import random
import sys
import time

from benchmarks.common import add_model_args, engine_args, log, model_stats, resolve_model, write_json


def make_prompts(vocab_size: int, num_requests: int, prefix_len: int, question_len: int,
                 seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(vocab_size) for _ in range(prefix_len)]
    return [system + [rng.randrange(vocab_size) for _ in range(question_len)]
            for _ in range(num_requests)]


def run_one(model: str, llm_kwargs: dict, prompts: list[list[int]], warm: list[list[int]],
            output_len: int) -> dict:
    from pagedllm import LLM, SamplingParams

    llm = LLM(model, **llm_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in warm], params, use_tqdm=False)
    llm.reset_prefix_cache()  # the timed run starts from an empty cache
    before = llm.get_metrics()
    t0 = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    after = llm.get_metrics()
    del llm
    gc.collect()

    def delta(key: str) -> float:
        return after[f"pagedllm:{key}"] - before[f"pagedllm:{key}"]

    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_prompt = sum(len(p) for p in prompts)
    return {"elapsed_s": elapsed, "tok_per_s": (num_prompt + num_out) / elapsed,
            "req_per_s": len(prompts) / elapsed, "num_prompt_tokens": num_prompt,
            "num_output_tokens": num_out,
            "prompt_tokens_computed": int(delta("prompt_tokens_computed")),
            "prefix_cache_queries": int(delta("prefix_cache_queries")),
            "prefix_cache_hits": int(delta("prefix_cache_hits")),
            "num_cached_tokens": sum(o.num_cached_tokens for o in outputs),
            "token_ids": [list(o.outputs[0].token_ids) for o in outputs]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedllm bench prefix", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=1024, help="shared system prompt tokens")
    parser.add_argument("--question-len", type=int, default=32, help="unique tokens per request")
    parser.add_argument("--output-len", type=int, default=16)
    args = parser.parse_args(argv)

    model = resolve_model(args)
    vocab = model_stats(model).vocab_size
    prompts = make_prompts(vocab, args.num_requests, args.prefix_len, args.question_len, seed=0)
    # Warm-up: same shapes, other tokens, a quarter of the requests.
    warm = make_prompts(vocab, max(args.num_requests // 4, 1), args.prefix_len, args.question_len, seed=1)
    log(f"prefix: {args.num_requests} requests x ({args.prefix_len} shared + {args.question_len} "
        f"unique) prompt tokens, {args.output_len} output tokens each; model {model}")

    runs = {}
    for enabled in (True, False):
        kwargs = engine_args(args, enable_prefix_caching=enabled)
        runs["on" if enabled else "off"] = run_one(model, kwargs, prompts, warm, args.output_len)
    on, off = runs["on"], runs["off"]
    same = sum(1 for a, b in zip(on["token_ids"], off["token_ids"]) if a == b)
    for r in runs.values():
        del r["token_ids"]
    speedup = off["elapsed_s"] / on["elapsed_s"]
    fewer = off["prompt_tokens_computed"] / max(on["prompt_tokens_computed"], 1)
    result = {"benchmark": "prefix", "model": model, "num_requests": args.num_requests,
              "prefix_len": args.prefix_len, "question_len": args.question_len,
              "output_len": args.output_len, "caching_on": on, "caching_off": off,
              "speedup": speedup, "prompt_tokens_computed_ratio": fewer, "outputs_agree": same}
    print(f"prefix ({args.num_requests} req x {args.prefix_len} shared + {args.question_len}): "
          f"caching on {on['tok_per_s']:.1f} tok/s, {on['prompt_tokens_computed']} prompt tokens "
          f"computed | off {off['tok_per_s']:.1f} tok/s, {off['prompt_tokens_computed']} computed | "
          f"speedup {speedup:.2f}x, {fewer:.1f}x fewer prompt tokens computed | "
          f"greedy outputs agree {same}/{args.num_requests}", flush=True)
    write_json(args.json, result)


if __name__ == "__main__":
    main(sys.argv[1:])
