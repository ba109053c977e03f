"""Speculative decoding: n-gram drafts against plain decoding, in the same run.

Workload "repetitive" (random.Random(0)): 16 requests whose prompts repeat a random 24..48-token
segment 3 or 4 times; each generates 64..128 tokens, greedy, ignore_eos. The same LLM settings run
twice, without and with ``speculative_config``; outputs must agree token for token (greedy
verification is exact). Prints tokens/s of both, the speed-up, the acceptance rate and the mean
tokens each request advances per verification step (1 + accepted drafts).

    pagedllm bench throughput --speculative [--speculative-config JSON] [--model DIR]
    python -m benchmarks.speculative
"""
from __future__ import annotations

import argparse
import json
import random
import time

from benchmarks.common import Workload, add_model_args, engine_args, log, model_stats, resolve_model, write_json

DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                "prompt_lookup_min": 2}


def repetitive_workload(vocab_size: int, num_requests: int = 16, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prompts, output_lens = [], []
    for _ in range(num_requests):
        segment = [rng.randrange(vocab_size) for _ in range(rng.randint(24, 48))]
        prompts.append(segment * rng.choice((3, 4)))
        output_lens.append(rng.randint(64, 128))
    return Workload("repetitive", prompts, output_lens)


def run(model: str, workload: Workload, llm_kwargs: dict) -> dict:
    from pagedllm import LLM

    llm = LLM(model, **llm_kwargs)
    params = workload.greedy_params()
    llm.generate(workload.as_prompts()[:2], params[:2], use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()
    before = llm.get_metrics()
    t0 = time.perf_counter()
    outputs = llm.generate(workload.as_prompts(), params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    after = llm.get_metrics()

    def delta(key: str) -> float:
        return after[key] - before[key]

    return {"elapsed_s": elapsed, "token_ids": [o.outputs[0].token_ids for o in outputs],
            "num_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
            "drafts": delta("pagedllm:spec_decode_num_drafts"),
            "draft_tokens": delta("pagedllm:spec_decode_num_draft_tokens"),
            "accepted_tokens": delta("pagedllm:spec_decode_num_accepted_tokens")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedllm bench speculative", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--speculative", action="store_true", help="(accepted for `bench throughput --speculative`)")
    parser.add_argument("--speculative-config", type=json.loads, default=DEFAULT_SPEC,
                        help=f"JSON, default {json.dumps(DEFAULT_SPEC)}")
    parser.add_argument("--num-requests", type=int, default=16)
    args = parser.parse_args(argv)

    model = resolve_model(args)
    workload = repetitive_workload(model_stats(model).vocab_size, args.num_requests)
    log(f"workload repetitive: {workload.num_requests} requests, {workload.num_output_tokens} output tokens")
    plain = run(model, workload, engine_args(args))
    spec = run(model, workload, engine_args(args, speculative_config=args.speculative_config))
    agree = sum(a == b for a, b in zip(plain["token_ids"], spec["token_ids"]))
    plain_tps = plain["num_tokens"] / plain["elapsed_s"]
    spec_tps = spec["num_tokens"] / spec["elapsed_s"]
    acceptance = spec["accepted_tokens"] / max(spec["draft_tokens"], 1)
    per_step = 1 + spec["accepted_tokens"] / max(spec["drafts"], 1)
    print(f"speculative repetitive ({workload.num_requests} req): ngram {spec_tps:.1f} tok/s vs plain "
          f"{plain_tps:.1f} tok/s ({spec_tps / plain_tps:.2f}x) | acceptance {acceptance:.1%}, "
          f"{per_step:.2f} tokens per verification step | greedy agree {agree}/{workload.num_requests}",
          flush=True)
    write_json(args.json, {"benchmark": "speculative", "model": model, "speculative_config": args.speculative_config,
                           "plain_tok_per_s": plain_tps, "spec_tok_per_s": spec_tps, "speedup": spec_tps / plain_tps,
                           "acceptance_rate": acceptance, "tokens_per_step": per_step, "greedy_agree": agree})


if __name__ == "__main__":
    main()
